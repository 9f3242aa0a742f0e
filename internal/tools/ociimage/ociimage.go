// Package ociimage writes a container image as an OCI image layout in a tar
// archive, without a container daemon: one layer holding a static binary
// (and, when given, the CA certificates it verifies TLS with) on an empty
// base. The same inputs give the same bytes: every timestamp, owner and
// order in the archive is fixed. Only the image build tool imports it.
package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"sort"
	"time"
)

// Media types of the OCI image specification.
const (
	MediaIndex    = "application/vnd.oci.image.index.v1+json"
	MediaManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaConfig   = "application/vnd.oci.image.config.v1+json"
	MediaLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
)

// Epoch dates every file and the image itself, so builds are reproducible.
var Epoch = time.Unix(0, 0).UTC()

// Config is one image.
type Config struct {
	// Name and Tag are the reference the archive carries (name:tag), the
	// one the manifests use, e.g. better-compute/bcd and 0.1.0.
	Name, Tag string
	// Arch is the GOARCH of the binary (the image's architecture).
	Arch string
	// Binary is the static binary's path on this machine; it becomes
	// /usr/local/bin/<BinaryName>, the entrypoint.
	Binary, BinaryName string
	// CABundle, when set, is copied to /etc/ssl/certs/ca-certificates.crt,
	// where Go looks for the system roots (an empty base has none).
	CABundle string
	// User is the image's user, "uid:gid" (65532:65532 for a process that
	// needs no root; the kubelet's securityContext may override it).
	User string
	// Out is the archive to write.
	Out string
}

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Platform    *platform         `json:"platform,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
}

// Build writes the image archive and returns the manifest's digest.
func Build(c Config) (string, error) {
	layer, diffID, err := buildLayer(c)
	if err != nil {
		return "", err
	}
	cfg, err := json.Marshal(map[string]any{
		"created":      Epoch.Format(time.RFC3339),
		"architecture": c.Arch,
		"os":           "linux",
		"config": map[string]any{
			"User":       c.User,
			"Entrypoint": []string{"/usr/local/bin/" + c.BinaryName},
			"Env":        []string{"PATH=/usr/local/bin", "SSL_CERT_DIR=/etc/ssl/certs"},
			"WorkingDir": "/",
			"Labels":     map[string]string{"org.opencontainers.image.version": c.Tag, "org.opencontainers.image.title": c.BinaryName},
		},
		"rootfs":  map[string]any{"type": "layers", "diff_ids": []string{diffID}},
		"history": []map[string]string{{"created": Epoch.Format(time.RFC3339), "created_by": "ociimage: " + c.BinaryName}},
	})
	if err != nil {
		return "", err
	}
	layerDesc := blobDesc(MediaLayer, layer)
	cfgDesc := blobDesc(MediaConfig, cfg)
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     MediaManifest,
		"config":        cfgDesc,
		"layers":        []descriptor{layerDesc},
	})
	if err != nil {
		return "", err
	}
	mDesc := blobDesc(MediaManifest, manifest)
	mDesc.Platform = &platform{Architecture: c.Arch, OS: "linux"}
	// ref.name is the OCI tag; io.containerd.image.name the full
	// reference containerd (ctr import, kind load) and podman load take.
	mDesc.Annotations = map[string]string{
		"org.opencontainers.image.ref.name": c.Tag,
		"io.containerd.image.name":          c.Name + ":" + c.Tag,
	}
	index, err := json.Marshal(map[string]any{"schemaVersion": 2, "mediaType": MediaIndex, "manifests": []descriptor{mDesc}})
	if err != nil {
		return "", err
	}
	files := map[string][]byte{
		"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`),
		"index.json": index,
	}
	for _, b := range [][]byte{layer, cfg, manifest} {
		files["blobs/sha256/"+hexSum(b)] = b
	}
	archive, err := tarOf([]string{"blobs/", "blobs/sha256/"}, files)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(c.Out, archive, 0o644); err != nil {
		return "", err
	}
	return mDesc.Digest, nil
}

// buildLayer returns the gzipped layer and its diff id (the digest of the
// uncompressed tar).
func buildLayer(c Config) (gz []byte, diffID string, err error) {
	bin, err := os.ReadFile(c.Binary)
	if err != nil {
		return nil, "", fmt.Errorf("read the binary: %w", err)
	}
	files := map[string][]byte{"usr/local/bin/" + c.BinaryName: bin}
	dirs := []string{"etc/", "tmp/", "usr/", "usr/local/", "usr/local/bin/"}
	// An /etc/passwd names the non-root user, for tools that look it up.
	files["etc/passwd"] = []byte("root:x:0:0:root:/:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/:/sbin/nologin\n")
	files["etc/group"] = []byte("root:x:0:\nnonroot:x:65532:\n")
	if c.CABundle != "" {
		ca, err := os.ReadFile(c.CABundle)
		if err != nil {
			return nil, "", fmt.Errorf("read the CA bundle: %w", err)
		}
		files["etc/ssl/certs/ca-certificates.crt"] = ca
		dirs = append(dirs, "etc/ssl/", "etc/ssl/certs/")
	}
	raw, err := tarOf(dirs, files)
	if err != nil {
		return nil, "", err
	}
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, "", err
	}
	zw.ModTime = Epoch
	if _, err := zw.Write(raw); err != nil {
		return nil, "", err
	}
	if err := zw.Close(); err != nil {
		return nil, "", err
	}
	return buf.Bytes(), "sha256:" + hexSum(raw), nil
}

// tarOf writes dirs and files in name order, owned by root, dated Epoch;
// binaries under bin/ are executable, /tmp is 1777.
func tarOf(dirs []string, files map[string][]byte) ([]byte, error) {
	type entry struct {
		name string
		data []byte
		dir  bool
	}
	var entries []entry
	for _, d := range dirs {
		entries = append(entries, entry{name: d, dir: true})
	}
	for n, b := range files {
		entries = append(entries, entry{name: n, data: b})
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].name < entries[j].name })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, ModTime: Epoch, Format: tar.FormatPAX, Uid: 0, Gid: 0}
		switch {
		case e.dir && e.name == "tmp/":
			h.Typeflag, h.Mode = tar.TypeDir, 0o1777
		case e.dir:
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		case path.Base(path.Dir(e.name)) == "bin":
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, 0o755, int64(len(e.data))
		default:
			h.Typeflag, h.Mode, h.Size = tar.TypeReg, 0o644, int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func hexSum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func blobDesc(mediaType string, b []byte) descriptor {
	return descriptor{MediaType: mediaType, Digest: "sha256:" + hexSum(b), Size: int64(len(b))}
}
