//go:build unix

package tokeninput

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
)

func osLookupEnv(k string) (string, bool) { return os.LookupEnv(k) }

// FromFile reads the token from path (--token-file, R11.2). The file must be
//
//   - a regular file (not a FIFO, device or directory), at most MaxSize
//     bytes;
//   - owned by the user bcd runs as, with mode 0600 or 0400, so nobody else
//     could have read it.
//
// path may be a symbolic link only when its target lies inside the link's
// own directory: that is how a Kubernetes Secret volume presents each key
// (token -> ..data/token -> ..2024_…/token), while a link pointing elsewhere
// (to a file bcd, as root, can read but the caller cannot) is refused.
// Every check is made on the opened file, so the file cannot be swapped
// between check and read.
//
// On success cleanup deletes path; call it after the join. A delete that
// fails because the mount is read-only (a Secret volume) or not permitted is
// returned as a warning, not an error; a file already gone is neither.
func FromFile(path string) (token string, cleanup func() (warning string, err error), err error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "--token-file: bad path: %v", err)
	}
	lst, err := os.Lstat(abs)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return "", nil, errs.New(errs.InvalidArgument, "--token-file: no file at %s", abs)
		}
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "--token-file: cannot stat %s: %v", abs, fsutil.WithoutPath(err))
	}
	target := abs
	if lst.Mode()&fs.ModeSymlink != 0 {
		if target, err = containedTarget(abs); err != nil {
			return "", nil, err
		}
	}

	// Check before opening too, so a file we may not open (mode 0000 for a
	// non-root bcd) still gets the message about its mode.
	if pre, err := os.Stat(target); err == nil {
		if err := checkFile(abs, pre); err != nil {
			return "", nil, err
		}
	}

	// O_NOFOLLOW: target is already resolved, so a link appearing there now
	// is a swap. O_NONBLOCK: opening a FIFO must not hang the join.
	fd, err := syscall.Open(target, syscall.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if err != nil {
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "--token-file: cannot open %s: %v", abs, err)
	}
	f := os.NewFile(uintptr(fd), target)
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "--token-file: cannot stat %s: %v", abs, fsutil.WithoutPath(err))
	}
	if err := checkFile(abs, st); err != nil {
		return "", nil, err
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxSize+1))
	if err != nil {
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "--token-file: cannot read %s: %v", abs, fsutil.WithoutPath(err))
	}
	if len(data) > MaxSize {
		return "", nil, errs.New(errs.InvalidArgument, "--token-file: %s holds more than %d bytes; a token file holds only the token", abs, MaxSize)
	}
	tok, err := Parse(string(data))
	if err != nil {
		e, _ := errs.As(err)
		return "", nil, errs.New(errs.InvalidArgument, "--token-file %s: %s", abs, e.Message)
	}
	return tok, func() (string, error) { return remove(abs, os.Remove) }, nil
}

// checkFile checks the opened file: regular, small, owned by us, owner-only.
func checkFile(name string, st fs.FileInfo) error {
	if !st.Mode().IsRegular() {
		return errs.New(errs.InvalidArgument, "--token-file: %s is not a regular file (%s)", name, st.Mode().Type())
	}
	if st.Size() > MaxSize {
		return errs.New(errs.InvalidArgument, "--token-file: %s is %d bytes; a token file holds at most %d", name, st.Size(), MaxSize)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return errs.New(errs.InvalidArgument, "--token-file: cannot tell who owns %s", name)
	}
	if uid := os.Geteuid(); int64(sys.Uid) != int64(uid) {
		return errs.New(errs.InvalidArgument, "--token-file: %s is owned by uid %d, not by uid %d that bcd runs as; only the owner may be able to read a token file", name, sys.Uid, uid)
	}
	// SECURITY: a token others could read may already be in their hands;
	// refuse instead of using it, so the operator revokes and reissues.
	mode := st.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	if mode != 0o600 && mode != 0o400 {
		return errs.New(errs.InvalidArgument,
			"--token-file: %s has mode %04o; a token file must be readable by its owner only, mode 0600 or 0400 (chmod 600 %s; for a Kubernetes Secret set defaultMode: 0400)",
			name, uint32(st.Mode().Perm()), name)
	}
	return nil
}

// containedTarget resolves a symbolic link and returns its target when the
// target lies inside the link's directory (resolved too).
func containedTarget(link string) (string, error) {
	dir, err := filepath.EvalSymlinks(filepath.Dir(link))
	if err != nil {
		return "", errs.Wrap(err, errs.InvalidArgument, "--token-file: cannot resolve %s: %v", filepath.Dir(link), fsutil.WithoutPath(err))
	}
	target, err := filepath.EvalSymlinks(link)
	if err != nil {
		return "", errs.New(errs.InvalidArgument, "--token-file: %s is a symbolic link that does not resolve", link)
	}
	if !strings.HasPrefix(target, dir+string(filepath.Separator)) {
		return "", errs.New(errs.InvalidArgument, "--token-file: %s is a symbolic link out of its directory; pass the file itself", link)
	}
	return target, nil
}

// remove deletes the token file after the join with rm (os.Remove; tests
// pass a fake to produce EROFS).
func remove(path string, rm func(string) error) (string, error) {
	err := rm(path)
	switch {
	case err == nil, errors.Is(err, fs.ErrNotExist):
		return "", nil
	case errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EBUSY),
		errors.Is(err, fs.ErrPermission):
		return fmt.Sprintf("could not delete the token file %s (%v); delete it, or the Secret that provides it, yourself", path, fsutil.WithoutPath(err)), nil
	}
	return "", fmt.Errorf("delete the token file %s: %w", path, err)
}
