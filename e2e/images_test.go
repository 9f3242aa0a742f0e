package e2e

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/manifest"
)

// ociArchive is an image archive of scripts/images, read back.
type ociArchive struct {
	files map[string][]byte
}

func readOCIArchive(t *testing.T, path string) ociArchive {
	t.Helper()
	f, err := os.Open(path)
	must(t, err)
	defer f.Close()
	a := ociArchive{files: map[string][]byte{}}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return a
		}
		must(t, err)
		b, err := io.ReadAll(tr)
		must(t, err)
		a.files[h.Name] = b
	}
}

func (a ociArchive) blob(t *testing.T, digest string, v any) []byte {
	t.Helper()
	b, ok := a.files["blobs/sha256/"+strings.TrimPrefix(digest, "sha256:")]
	if !ok {
		t.Fatalf("no blob %s", digest)
	}
	if v != nil {
		must(t, json.Unmarshal(b, v))
	}
	return b
}

type ociDesc struct {
	Digest      string            `json:"digest"`
	Annotations map[string]string `json:"annotations"`
}

// unpack extracts the image's one layer into root and returns the
// image's reference, user and entrypoint.
func (a ociArchive) unpack(t *testing.T, root string) (ref, user string, entrypoint []string) {
	t.Helper()
	var index struct{ Manifests []ociDesc }
	must(t, json.Unmarshal(a.files["index.json"], &index))
	if len(index.Manifests) != 1 {
		t.Fatalf("index.json: %d manifests", len(index.Manifests))
	}
	var m struct {
		Config ociDesc
		Layers []ociDesc
	}
	a.blob(t, index.Manifests[0].Digest, &m)
	var cfg struct {
		Config struct {
			User       string
			Entrypoint []string
		}
	}
	a.blob(t, m.Config.Digest, &cfg)
	if len(m.Layers) != 1 {
		t.Fatalf("%d layers, want one on an empty base", len(m.Layers))
	}
	zr, err := gzip.NewReader(bytes.NewReader(a.blob(t, m.Layers[0].Digest, nil)))
	must(t, err)
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(t, err)
		p := filepath.Join(root, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			must(t, os.MkdirAll(p, 0o755))
			continue
		}
		b, err := io.ReadAll(tr)
		must(t, err)
		must(t, os.WriteFile(p, b, os.FileMode(h.Mode)&0o777))
	}
	return index.Manifests[0].Annotations["io.containerd.image.name"], cfg.Config.User, cfg.Config.Entrypoint
}

// buildImages runs the repository's one command for the images.
func buildImages(t *testing.T, out string) string {
	t.Helper()
	cmd := exec.Command("go", "run", "./internal/tools/images", "--out", out)
	cmd.Dir = ".."
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("scripts/images: %v\n%s", err, b)
	}
	return string(b)
}

// R24.2: scripts/images builds both images without a container daemon,
// reproducibly; each is the reference the manifests name, better-compute
// runs as a non-root user, and each binary runs from the image's root
// filesystem.
func TestContainerImagesR24_2(t *testing.T) {
	dir := t.TempDir()
	first := buildImages(t, filepath.Join(dir, "a"))
	second := buildImages(t, filepath.Join(dir, "b"))
	digests := regexp.MustCompile(`sha256:[0-9a-f]{64}`)
	if d1, d2 := digests.FindAllString(first, -1), digests.FindAllString(second, -1); len(d1) != 2 || strings.Join(d1, " ") != strings.Join(d2, " ") {
		t.Fatalf("two builds differ or are not two images:\n%s\n%s", first, second)
	}
	named := readFile(t, manifest.Path("base", "kustomization.yaml")) + readFile(t, manifest.Path("control-plane", "kustomization.yaml"))
	archives, err := filepath.Glob(filepath.Join(dir, "a", "*.oci.tar"))
	must(t, err)
	if len(archives) != 2 {
		t.Fatalf("archives %v", archives)
	}
	for _, archive := range archives {
		root := filepath.Join(dir, "root-"+filepath.Base(archive))
		ref, user, entry := readOCIArchive(t, archive).unpack(t, root)
		name, tag, _ := strings.Cut(ref, ":")
		if !strings.Contains(named, "newName: "+name+"\n    newTag: "+tag+"\n") {
			t.Errorf("%s: the manifests do not name %s", archive, ref)
		}
		bin := filepath.Base(entry[0])
		if want := map[string]string{"better-compute": "65532:65532", "bcd": "0:0"}[bin]; user != want {
			t.Errorf("%s: user %q, want %q", ref, user, want)
		}
		out, errOut, code := run(t, nil, "", filepath.Join(root, entry[0]), "--help")
		if code != 0 || !strings.Contains(out, "Usage:") {
			t.Errorf("%s from the image's root filesystem: %d %s %s", entry[0], code, out, errOut)
		}
		if _, err := os.Stat(filepath.Join(root, "etc/ssl/certs/ca-certificates.crt")); err != nil {
			t.Errorf("%s: no CA certificates for --server and the API: %v", ref, err)
		}
	}
}
