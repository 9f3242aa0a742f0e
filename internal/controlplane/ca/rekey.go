package ca

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/better-compute/better-compute/internal/shared/fsutil"
)

// While BETTER_COMPUTE_SECRET rotates, each key file of a bundle directory
// has a sibling under the other secret: <file>.next under the next secret
// (prepared), <file>.prev under the previous one (activated over). Load
// opens whichever its secret decrypts.
const (
	SuffixNext = ".next"
	SuffixPrev = ".prev"
)

// KeyFiles lists the encrypted key files of a bundle directory.
var KeyFiles = []string{FileNodeCAKey, FileServingCAKey, FileCommandSigningKey, FileJoinSigningKey, FileJoinEncryptionKey}

// RekeyDir writes, beside each key file of dir, <file>.next: the same key
// encrypted under newSecret. It decrypts with oldSecret (the key file, or
// its .prev/.next sibling, as Load does).
func RekeyDir(dir string, oldSecret, newSecret []byte) error {
	if err := CheckSecret(newSecret); err != nil {
		return err
	}
	for _, name := range KeyFiles {
		path := filepath.Join(dir, name)
		key, err := loadKey(path, oldSecret)
		if err != nil {
			return err
		}
		data, err := EncryptKey(key, newSecret)
		if err != nil {
			return fmt.Errorf("encrypt %s: %w", name, err)
		}
		if err := fsutil.WriteFileAtomic(path+SuffixNext, data, 0o600); err != nil {
			return err
		}
	}
	fsutil.SyncDir(dir)
	return nil
}

// SwapDirKeys makes each key file's .next sibling the key file and keeps
// the old one as .prev (forward), or undoes that (back). A file already
// swapped is left alone, so a swap interrupted halfway can be run again.
func SwapDirKeys(dir string, forward bool) error {
	for _, name := range KeyFiles {
		path := filepath.Join(dir, name)
		from, to := path+SuffixNext, path+SuffixPrev
		if !forward {
			from, to = path+SuffixPrev, path+SuffixNext
		}
		if _, err := os.Stat(from); errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if _, err := os.Stat(path); err == nil {
			if err := os.Rename(path, to); err != nil {
				return fmt.Errorf("keep %s: %w", name, err)
			}
		}
		if err := os.Rename(from, path); err != nil {
			return fmt.Errorf("swap %s: %w", name, err)
		}
	}
	fsutil.SyncDir(dir)
	return nil
}

// DropDirKeys removes each key file's sibling with suffix (SuffixPrev once
// the old secret is retired, SuffixNext when a prepared secret is dropped).
func DropDirKeys(dir, suffix string) error {
	for _, name := range KeyFiles {
		if err := os.Remove(filepath.Join(dir, name) + suffix); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	fsutil.SyncDir(dir)
	return nil
}
