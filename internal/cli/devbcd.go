package cli

import (
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/installscript"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// dev serves a bcd build under its downloads path (R11.5), so the install
// script can be tried against it on one laptop:
//
//	{base-url}{base-path}/downloads/bcd/{version}/linux-{arch}
//
// for the machine's own arch. The build is, in order: --bcd-binary; the
// `bcd` beside the running better-compute (go build -o bin/ ./cmd/...); or
// one built on demand with `go build` from the module in the working
// directory (go run ./cmd/better-compute dev). A file is served only when
// it is an ELF executable for linux and that arch: a macOS sibling, a shell
// script, a bcd for another CPU are skipped. Without one, dev runs and says
// that the install script step is unavailable.

// devBCDBuildTimeout bounds the on-demand go build.
const devBCDBuildTimeout = 5 * time.Minute

// devDownload is the bcd dev serves.
type devDownload struct {
	Version, Arch, SHA256 string
	// Source says where the build came from, for the log.
	Source string
}

// devArch returns the arch dev serves bcd for, or "" when bcd is not built
// for this CPU.
func devArch() string {
	switch runtime.GOARCH {
	case "amd64", "arm64":
		return runtime.GOARCH
	}
	return ""
}

// devVersion is the download path's version: this build's, when the install
// script accepts it, else 0.0.0-dev.
func devVersion() string {
	if installscript.ValidVersion(version.Version) {
		return version.Version
	}
	return "0.0.0-dev"
}

// checkLinuxELF reports why path is not a linux executable for arch, or nil.
func checkLinuxELF(path, arch string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s is not a linux executable (ELF): %w", path, err)
	}
	defer f.Close()
	want := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[arch]
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("%s is an ELF %s, not an executable", path, f.Type)
	}
	if f.Machine != want {
		return fmt.Errorf("%s is built for %s, not linux-%s", path, f.Machine, arch)
	}
	return nil
}

// devBCD puts a bcd build into downloadsDir as bcd/{version}/linux-{arch}
// and returns what it serves. explicit is --bcd-binary ("" to look for one
// beside self, the running executable). build makes a bcd at a path when no
// file was found (nil: never build).
func devBCD(ctx context.Context, log *slog.Logger, downloadsDir, explicit, self string, build func(ctx context.Context, out, arch string) error) (*devDownload, error) {
	arch := devArch()
	if arch == "" {
		return nil, errs.New(errs.InvalidState, "bcd is built for amd64 and arm64, not %s", runtime.GOARCH)
	}
	d := &devDownload{Version: devVersion(), Arch: arch}
	var src string
	switch {
	case explicit != "":
		if err := checkLinuxELF(explicit, arch); err != nil {
			return nil, errs.Invalid("--bcd-binary", "%v", err)
		}
		src, d.Source = explicit, "--bcd-binary "+explicit
	case self != "":
		if exe, err := filepath.EvalSymlinks(self); err == nil {
			sib := filepath.Join(filepath.Dir(exe), "bcd")
			if err := checkLinuxELF(sib, arch); err == nil {
				src, d.Source = sib, "the bcd beside better-compute, "+sib
			} else if !errors.Is(err, fs.ErrNotExist) {
				log.Info("not serving the bcd beside better-compute", "reason", err)
			}
		}
	}
	dst := filepath.Join(downloadsDir, "bcd", d.Version, "linux-"+arch)
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return nil, err
	}
	tmp := dst + ".new"
	_ = os.Remove(tmp)
	if src == "" {
		if build == nil {
			return nil, errs.New(errs.NotFound, "no bcd to serve: put bcd beside better-compute (go build -o bin/ ./cmd/...) or pass --bcd-binary")
		}
		log.Info("building bcd for the install script (go build ./cmd/bcd); pass --bcd-binary to skip", "arch", arch)
		bctx, cancel := context.WithTimeout(ctx, devBCDBuildTimeout)
		err := build(bctx, tmp, arch)
		cancel()
		if err != nil {
			_ = os.Remove(tmp)
			return nil, fmt.Errorf("no bcd to serve: put bcd beside better-compute (go build -o bin/ ./cmd/...) or pass --bcd-binary; building one failed: %w", err)
		}
		if err := checkLinuxELF(tmp, arch); err != nil {
			_ = os.Remove(tmp)
			return nil, err
		}
		d.Source = "built with go build"
	} else if err := placeFile(src, tmp, os.Link, copyFile); err != nil {
		return nil, err
	}
	// The link or copy is what is served and hashed: a rebuild of the
	// source while dev runs (go build replaces the file, a new inode)
	// changes neither.
	sum, err := fileSHA256(tmp)
	if err != nil {
		return nil, err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return nil, err
	}
	d.SHA256 = sum
	return d, nil
}

// goBuildBCD builds cmd/bcd for linux-arch with the go command, from the
// module in the working directory.
func goBuildBCD(ctx context.Context, out, arch string) error {
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "github.com/better-compute/better-compute/cmd/bcd")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
	msg, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%v: %s", err, strings.TrimSpace(string(msg)))
	}
	return nil
}

// placeFile puts src at dst: a hard link when both are on one filesystem
// (no space used, so dev runs on a small disk), else a copy. A copy that
// runs out of space says how much it needs.
func placeFile(src, dst string, link, copy func(src, dst string) error) error {
	if link(src, dst) == nil {
		return nil
	}
	err := copy(src, dst)
	if err == nil {
		return nil
	}
	_ = os.Remove(dst)
	if errors.Is(err, syscall.ENOSPC) {
		need := "its size"
		if fi, serr := os.Stat(src); serr == nil {
			need = fmt.Sprintf("%d MiB", (fi.Size()+1<<20-1)>>20)
		}
		return errs.New(errs.InvalidState, "no space left to copy bcd into %s: it needs %s free there (or put the data directory on the filesystem of %s, where it is hard-linked instead)",
			filepath.Dir(dst), need, src)
	}
	return err
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func fileSHA256(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
