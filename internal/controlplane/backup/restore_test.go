package backup_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// takeBackup backs a new control plane with one live token up and returns
// the archive and the token's id.
func takeBackup(t testing.TB) (string, string) {
	t.Helper()
	p := newPlane(t)
	tok := p.token(t, p.pool(t).Id, 5, false)
	out := filepath.Join(t.TempDir(), "bc.backup")
	if _, err := backup.Create(context.Background(), backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: out}); err != nil {
		t.Fatal(err)
	}
	return out, tok.Id
}

// rewrite copies the archive in to a new file, passing each member's bytes
// through edit (nil drops the member).
func rewrite(t testing.TB, in string, edit func(name string, b []byte) []byte) string {
	t.Helper()
	f, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	tw := tar.NewWriter(zw)
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if b = edit(h.Name, b); b == nil {
			continue
		}
		h.Size = int64(len(b))
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "edited.backup")
	if err := os.WriteFile(out, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return out
}

// editManifest rewrites the manifest's JSON fields.
func editManifest(t testing.TB, in string, edit func(m map[string]any)) string {
	t.Helper()
	return rewrite(t, in, func(name string, b []byte) []byte {
		if name != "manifest.json" {
			return b
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		edit(m)
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		return out
	})
}

// R16.3: a restore refuses a schema newer than this binary, an archive that
// does not match its manifest, and a data directory that holds anything;
// a refused restore leaves nothing behind (no target, no staging).
func TestRestoreRefusals(t *testing.T) {
	good, _ := takeBackup(t)
	known, _ := store.KnownSchemaVersion(store.SQLite)
	flip := func(member string) string {
		return rewrite(t, good, func(name string, b []byte) []byte {
			if name == member {
				b = bytes.Clone(b)
				b[len(b)/2] ^= 0xff
			}
			return b
		})
	}
	raw, _ := os.ReadFile(good)
	truncated := filepath.Join(t.TempDir(), "truncated")
	_ = os.WriteFile(truncated, raw[:len(raw)/2], 0o600)
	garbage := filepath.Join(t.TempDir(), "garbage")
	_ = os.WriteFile(garbage, []byte("not an archive"), 0o600)

	full := t.TempDir()
	_ = os.WriteFile(filepath.Join(full, "bc.db"), []byte("someone's"), 0o600)
	for _, tc := range []struct {
		name, in, dir string
		code          errs.Code
		msg           string
	}{
		{"newer schema", editManifest(t, good, func(m map[string]any) { m["schemaVersion"] = known + 1 }), "", errs.InvalidState, "is newer than this binary knows"},
		{"newer format", editManifest(t, good, func(m map[string]any) { m["format"] = 2 }), "", errs.InvalidState, "backup format 2"},
		{"schema not the copy's", editManifest(t, good, func(m map[string]any) { m["schemaVersion"] = known - 1 }), "", errs.InvalidArgument, "the manifest says"},
		{"database altered", flip("db/bc.db"), "", errs.InvalidArgument, "db/bc.db does not match its SHA-256"},
		{"key altered", flip("pki/node-ca.key"), "", errs.InvalidArgument, "pki/node-ca.key does not match its SHA-256"},
		{"member dropped", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "pki/bundle.json" {
				return nil
			}
			return b
		}), "", errs.InvalidArgument, "1 of the manifest's"},
		{"member added", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "pki/bundle.json" {
				b = append(b, ' ')
			}
			return b
		}), "", errs.InvalidArgument, "pki/bundle.json"},
		{"path escape", editManifest(t, good, func(m map[string]any) {
			m["files"] = append(m["files"].([]any), map[string]any{"name": "pki/../../x", "size": 1, "sha256": string(bytes.Repeat([]byte("a"), 64))})
		}), "", errs.InvalidArgument, "member name"},
		{"truncated", truncated, "", errs.InvalidArgument, "damaged"},
		{"not an archive", garbage, "", errs.InvalidArgument, "damaged"},
		{"missing", filepath.Join(t.TempDir(), "none"), "", errs.InvalidArgument, "--in"},
		{"non-empty target", good, full, errs.AlreadyExists, "is not empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := tc.dir
			if dir == "" {
				dir = filepath.Join(parent, "restored")
			}
			_, err := backup.Restore(context.Background(), backup.RestoreConfig{In: tc.in, DataDir: dir})
			wantErr(t, err, tc.code, tc.msg)
			if tc.dir == "" {
				if ents, _ := os.ReadDir(parent); len(ents) != 0 {
					t.Errorf("a refused restore left %v", ents)
				}
			} else if b, _ := os.ReadFile(filepath.Join(dir, "bc.db")); string(b) != "someone's" {
				t.Errorf("a refused restore changed the target: %q", b)
			}
			if tc.code == errs.InvalidArgument || tc.code == errs.InvalidState {
				if _, err := backup.Verify(context.Background(), tc.in); !errs.Is(err, tc.code) {
					t.Errorf("Verify = %v, want %s", err, tc.code)
				}
			}
		})
	}
	if _, err := backup.Verify(context.Background(), good); err != nil {
		t.Errorf("Verify of a good archive: %v", err)
	}
}

// R16.3: an empty directory is a fresh target; --keep-tokens keeps the
// backup's tokens live.
func TestRestoreEmptyDirKeepTokens(t *testing.T) {
	good, tok := takeBackup(t)
	dir := t.TempDir()
	res, err := backup.Restore(context.Background(), backup.RestoreConfig{In: good, DataDir: dir, KeepTokens: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.RevokedTokens) != 0 {
		t.Errorf("--keep-tokens revoked %v", res.RevokedTokens)
	}
	for p, mode := range map[string]os.FileMode{dir: 0o700, res.DBPath: 0o600, res.PKIDir: 0o700, filepath.Join(res.PKIDir, "node-ca.key"): 0o600, filepath.Join(res.PKIDir, "node-ca.crt"): 0o644} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != mode {
			t.Errorf("%s: %v, %v; want mode %o", p, fi, err, mode)
		}
	}
	r := restorePlane(t, dir)
	if j := r.tokenRow(t, tok); !j.Live {
		t.Errorf("token %+v, want it live", j)
	}
}
