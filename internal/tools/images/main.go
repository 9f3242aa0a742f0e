// Command images builds the container images of better-compute and bcd
// without a container daemon: each is a static build (CGO_ENABLED=0,
// -trimpath, no build id) in one layer on an empty base, written as an OCI
// image layout archive (ociimage). The same source and CA bundle give the
// same bytes. Run it from the repository: scripts/images.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"

	"github.com/better-compute/better-compute/internal/shared/version"
	"github.com/better-compute/better-compute/internal/tools/ociimage"
)

// images are what the manifests in deploy/kubernetes name. bcd runs as
// root (it reads the root-only DMI serials under /sys and owns
// /var/lib/bcd on the host); better-compute needs no root.
var images = []struct{ name, binary, pkg, user string }{
	{"better-compute/better-compute", "better-compute", "./cmd/better-compute", "65532:65532"},
	{"better-compute/bcd", "bcd", "./cmd/bcd", "0:0"},
}

func main() {
	out := flag.String("out", "images", "directory for the archives")
	arch := flag.String("arch", runtime.GOARCH, "GOARCH to build for (linux)")
	tag := flag.String("tag", version.Version, "image tag")
	caBundle := flag.String("ca-bundle", "/etc/ssl/certs/ca-certificates.crt", "CA certificates to put in the images (empty: none)")
	flag.Parse()
	if err := run(*out, *arch, *tag, *caBundle); err != nil {
		fmt.Fprintln(os.Stderr, "images:", err)
		os.Exit(1)
	}
}

func run(out, arch, tag, caBundle string) error {
	if caBundle != "" {
		if _, err := os.Stat(caBundle); err != nil {
			return fmt.Errorf("--ca-bundle: %w (give --ca-bundle '' for images without CA certificates)", err)
		}
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "bc-images-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	for _, im := range images {
		bin := filepath.Join(work, im.binary)
		build := exec.Command("go", "build", "-trimpath", "-ldflags=-buildid=", "-o", bin, im.pkg)
		build.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("go build %s: %w", im.pkg, err)
		}
		archive := filepath.Join(out, fmt.Sprintf("%s-%s-linux-%s.oci.tar", im.binary, tag, arch))
		digest, err := ociimage.Build(ociimage.Config{
			Name: im.name, Tag: tag, Arch: arch, Binary: bin, BinaryName: im.binary,
			CABundle: caBundle, User: im.user, Out: archive,
		})
		if err != nil {
			return fmt.Errorf("%s: %w", im.name, err)
		}
		fmt.Printf("%s:%s %s %s\n", im.name, tag, digest, archive)
	}
	return nil
}
