package cli

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// R11.5: dev serves only a linux executable for the machine's arch, from
// --bcd-binary, else from a build when none is beside better-compute.
func TestDevBCD(t *testing.T) {
	if devArch() == "" {
		t.Skip("bcd is not built for " + runtime.GOARCH)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if runtime.GOOS != "linux" {
		t.Skip("the test binary is not a linux executable")
	}
	other := map[string]string{"amd64": "arm64", "arm64": "amd64"}[devArch()]
	if err := checkLinuxELF(exe, other); err == nil || !strings.Contains(err.Error(), "not linux-"+other) {
		t.Fatalf("an executable for %s passed as %s: %v", devArch(), other, err)
	}
	script := filepath.Join(t.TempDir(), "bcd")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho fake\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	// --bcd-binary: served as it is, under the version's path.
	dir := t.TempDir()
	d, err := devBCD(context.Background(), quiet, dir, exe, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	served := filepath.Join(dir, "bcd", devVersion(), "linux-"+devArch())
	if sum, _ := fileSHA256(served); sum != d.SHA256 || d.Arch != devArch() {
		t.Fatalf("served %s, want sha %s", sum, d.SHA256)
	}
	if want, _ := fileSHA256(exe); want != d.SHA256 {
		t.Fatal("the served copy differs from --bcd-binary")
	}

	// A --bcd-binary that is not a linux executable is refused by name.
	_, err = devBCD(context.Background(), quiet, t.TempDir(), script, "", nil)
	if e, ok := errs.As(err); !ok || e.Code != errs.InvalidArgument || e.Field != "--bcd-binary" {
		t.Fatalf("a shell script: %v", err)
	}

	// The bcd beside better-compute (found through a symlink to it, as in
	// a PATH directory), when it is a linux executable; a script there is
	// passed over for the build.
	bin := t.TempDir()
	link := filepath.Join(t.TempDir(), "better-compute")
	if err := os.Symlink(filepath.Join(bin, "better-compute"), link); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "better-compute"), []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	exeBytes, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "bcd"), exeBytes, 0o755); err != nil {
		t.Fatal(err)
	}
	never := func(context.Context, string, string) error { t.Error("built although a bcd was found"); return nil }
	d, err = devBCD(context.Background(), quiet, t.TempDir(), "", link, never)
	if err != nil || d.Source != "the bcd beside better-compute, "+filepath.Join(bin, "bcd") {
		t.Fatalf("sibling: %+v %v", d, err)
	}
	if err := os.WriteFile(filepath.Join(bin, "bcd"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	// No usable sibling: the build is used, and checked like any other
	// file.
	built := 0
	d, err = devBCD(context.Background(), quiet, t.TempDir(), "", link, func(ctx context.Context, out, arch string) error {
		built++
		if arch != devArch() {
			t.Errorf("built for %s", arch)
		}
		b, err := os.ReadFile(exe)
		if err != nil {
			return err
		}
		return os.WriteFile(out, b, 0o755)
	})
	if err != nil || built != 1 || d.Source != "built with go build" {
		t.Fatalf("build: %+v %v (built %d)", d, err, built)
	}
	dir = t.TempDir()
	_, err = devBCD(context.Background(), quiet, dir, "", "", func(ctx context.Context, out, arch string) error {
		return os.WriteFile(out, []byte("#!/bin/sh\n"), 0o755)
	})
	if err == nil || !strings.Contains(err.Error(), "not a linux executable") {
		t.Fatalf("a build that made a script: %v", err)
	}
	_, err = devBCD(context.Background(), quiet, dir, "", "", func(ctx context.Context, out, arch string) error {
		return errors.New("go: command not found")
	})
	if err == nil || !strings.Contains(err.Error(), "pass --bcd-binary; building one failed: go: command not found") {
		t.Fatalf("a failed build: %v", err)
	}
	// Neither leaves a file to serve.
	if _, err := os.Stat(filepath.Join(dir, "bcd", devVersion(), "linux-"+devArch())); err == nil {
		t.Fatal("a failed build left a download")
	}
	if _, err := os.Stat(filepath.Join(dir, "bcd", devVersion(), "linux-"+devArch()+".new")); err == nil {
		t.Fatal("a failed build left its temporary file")
	}
}

// R11.5: dev hard-links the bcd it serves when it can (a small disk holds
// dev's data directory), copies it otherwise, and a copy out of space says
// how much it needs.
func TestPlaceFile(t *testing.T) {
	noLink := func(src, dst string) error { return &os.LinkError{Op: "link", Old: src, New: dst, Err: syscall.EXDEV} }
	full := func(src, dst string) error {
		_ = os.WriteFile(dst, []byte("part"), 0o755)
		return &os.PathError{Op: "write", Path: dst, Err: syscall.ENOSPC}
	}
	for _, tc := range []struct {
		name       string
		link, copy func(src, dst string) error
		linked     bool
		wantErr    string
	}{
		{name: "same filesystem", link: os.Link, copy: copyFile, linked: true},
		{name: "another filesystem", link: noLink, copy: copyFile},
		{name: "no space", link: noLink, copy: full, wantErr: "it needs 3 MiB free there"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			src, dst := filepath.Join(dir, "bcd"), filepath.Join(dir, "served")
			if err := os.WriteFile(src, make([]byte, 2<<20+1), 0o755); err != nil {
				t.Fatal(err)
			}
			err := placeFile(src, dst, tc.link, tc.copy)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, want %q", err, tc.wantErr)
				}
				if _, serr := os.Stat(dst); !errors.Is(serr, fs.ErrNotExist) {
					t.Fatalf("the partial copy stayed: %v", serr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			a, _ := os.Stat(src)
			b, err := os.Stat(dst)
			if err != nil || b.Size() != a.Size() || os.SameFile(a, b) != tc.linked {
				t.Fatalf("placed %v (err %v), linked want %v", b, err, tc.linked)
			}
		})
	}
}
