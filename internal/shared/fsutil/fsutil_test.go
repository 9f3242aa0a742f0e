package fsutil

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteNewNeverReplaces(t *testing.T) {
	p := filepath.Join(t.TempDir(), "key")
	if err := WriteNew(p, []byte("one"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteNew(p, []byte("two"), 0o600); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second WriteNew: %v", err)
	}
	b, _ := os.ReadFile(p)
	st, _ := os.Stat(p)
	if string(b) != "one" || st.Mode().Perm() != 0o600 {
		t.Fatalf("file = %q %v", b, st.Mode())
	}
}

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "config.toml")
	for _, data := range []string{"a", "bb"} {
		if err := WriteFileAtomic(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		if b, _ := os.ReadFile(p); string(b) != data {
			t.Fatalf("content %q, want %q", b, data)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("temporary files left: %v", ents)
	}
	if err := WriteFileAtomic(filepath.Join(dir, "missing", "x"), nil, 0o644); err == nil {
		t.Fatal("write into a missing directory succeeded")
	}
}
