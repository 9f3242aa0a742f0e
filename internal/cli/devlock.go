package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// devLockFile is held (flock) by the dev that runs on a data directory,
// and names it: a second dev on the same directory would rewrite dev.env
// and every bcd config under the first one's feet.
const devLockFile = "dev.lock"

// devMarkers are files only dev writes: a directory holding none of them
// is not a dev data directory, and dev refuses to write over its files.
var devMarkers = []string{"dev-secret", "dev.env", devLockFile, dbFile, filepath.Join("pki", ca.FileManifest)}

// checkDevDir refuses an existing, non-empty directory that dev did not
// make (dev would overwrite files such as gateway.key in it).
func checkDevDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) || (err == nil && len(entries) == 0) {
		return nil
	}
	if err != nil {
		return errs.Invalid("--data-dir", "%v", err)
	}
	for _, m := range devMarkers {
		if _, err := os.Stat(filepath.Join(dir, m)); err == nil {
			return nil
		}
	}
	return errs.Invalid("--data-dir", "%s is not empty and is not a better-compute dev data directory (no dev-secret, dev.env or bc.db): dev would overwrite its files; give a new or empty directory", dir)
}

// devLock is the held lock on a data directory.
type devLock struct{ f *os.File }

// lockDevDir takes the directory's lock, or refuses naming the dev that
// holds it (its pid and addresses, as it wrote them).
func lockDevDir(dir string) (*devLock, error) {
	path := filepath.Join(dir, devLockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			who := strings.TrimSpace(string(holder))
			if who == "" {
				who = "starting"
			}
			return nil, errs.New(errs.Conflict, "another better-compute dev is running on %s (%s): stop it first, or give another --data-dir", dir, who)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return &devLock{f: f}, nil
}

// note records who holds the lock, for the refusal a second dev prints.
func (l *devLock) note(format string, args ...any) {
	_ = l.f.Truncate(0)
	_, _ = l.f.WriteAt([]byte(fmt.Sprintf(format, args...)+"\n"), 0)
}

// release unlocks; the file stays, empty, so the directory still reads as
// dev's.
func (l *devLock) release() {
	_ = l.f.Truncate(0)
	_ = l.f.Close()
}

// inUse says that a dev address is taken, most likely by another dev.
func inUse(err error, flag, addr string) error {
	if errors.Is(err, syscall.EADDRINUSE) {
		return errs.Wrap(err, errs.Conflict, "%s %s is in use: another better-compute dev is probably running (stop it), or give another %s (:0 picks a free port)", flag, addr, flag)
	}
	return err
}
