package backup_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
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
	if _, err := backup.Create(context.Background(), backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: out, Secret: testSecret}); err != nil {
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

// editManifest rewrites the manifest's JSON fields and writes its MAC
// again under testSecret, as someone holding the secret could: the
// restore's own checks of the manifest then decide.
func editManifest(t testing.TB, in string, edit func(m map[string]any)) string {
	t.Helper()
	return reseal(t, in, testSecret, func(name string, b []byte) []byte {
		if name == "manifest.json" {
			return editJSON(t, b, edit)
		}
		return b
	})
}

// reseal rewrites the archive through edit and, with a secret, writes the
// MAC of the edited manifest under it; without one the old MAC stays.
func reseal(t testing.TB, in string, secret []byte, edit func(name string, b []byte) []byte) string {
	t.Helper()
	var manifest []byte
	return rewrite(t, in, func(name string, b []byte) []byte {
		b = edit(name, b)
		switch {
		case name == "manifest.json":
			manifest = b
		case name == "manifest.mac" && b != nil && secret != nil:
			mac, err := backup.SealManifest(manifest, secret)
			if err != nil {
				t.Fatal(err)
			}
			return mac
		}
		return b
	})
}

func editJSON(t testing.TB, b []byte, edit func(m map[string]any)) []byte {
	t.Helper()
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
}

// editDB edits the database copy and writes its size and SHA-256 into the
// manifest, as someone without the secret could: the old MAC stays.
func editDB(t testing.TB, in string) string {
	t.Helper()
	var db []byte
	// The manifest comes first: read the copy's new bytes in a first pass.
	rewrite(t, in, func(name string, b []byte) []byte {
		if name == "db/bc.db" {
			db = bytes.Clone(b)
			db[len(db)-1] ^= 0xff
		}
		return b
	})
	sum := sha256.Sum256(db)
	return reseal(t, in, nil, func(name string, b []byte) []byte {
		switch name {
		case "db/bc.db":
			return db
		case "manifest.json":
			return editJSON(t, b, func(m map[string]any) {
				for _, f := range m["files"].([]any) {
					if f := f.(map[string]any); f["name"] == "db/bc.db" {
						f["sha256"], f["size"] = hex.EncodeToString(sum[:]), len(db)
					}
				}
			})
		}
		return b
	})
}

// unauthenticated is the archive as an older release wrote it: format 1,
// no MAC.
func unauthenticated(t testing.TB, in string) string {
	t.Helper()
	return rewrite(t, in, func(name string, b []byte) []byte {
		switch name {
		case "manifest.mac":
			return nil
		case "manifest.json":
			return editJSON(t, b, func(m map[string]any) { m["format"] = backup.FormatUnauthenticated })
		}
		return b
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
		secret        []byte // nil: testSecret
	}{
		{"newer schema", editManifest(t, good, func(m map[string]any) { m["schemaVersion"] = known + 1 }), "", errs.InvalidState, "is newer than this binary knows", nil},
		{"newer format", editManifest(t, good, func(m map[string]any) { m["format"] = 3 }), "", errs.InvalidState, "backup format 3", nil},
		{"schema not the copy's", editManifest(t, good, func(m map[string]any) { m["schemaVersion"] = known - 1 }), "", errs.InvalidArgument, "the manifest says", nil},
		{"database altered", flip("db/bc.db"), "", errs.InvalidArgument, "db/bc.db does not match its SHA-256", nil},
		{"key altered", flip("pki/node-ca.key"), "", errs.InvalidArgument, "pki/node-ca.key does not match its SHA-256", nil},
		{"member dropped", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "pki/bundle.json" {
				return nil
			}
			return b
		}), "", errs.InvalidArgument, "1 of the manifest's", nil},
		{"member added", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "pki/bundle.json" {
				b = append(b, ' ')
			}
			return b
		}), "", errs.InvalidArgument, "pki/bundle.json", nil},
		{"path escape", editManifest(t, good, func(m map[string]any) {
			m["files"] = append(m["files"].([]any), map[string]any{"name": "pki/../../x", "size": 1, "sha256": string(bytes.Repeat([]byte("a"), 64))})
		}), "", errs.InvalidArgument, "member name", nil},
		{"truncated", truncated, "", errs.InvalidArgument, "damaged", nil},
		{"not an archive", garbage, "", errs.InvalidArgument, "damaged", nil},
		{"missing", filepath.Join(t.TempDir(), "none"), "", errs.InvalidArgument, "--in", nil},
		{"non-empty target", good, full, errs.AlreadyExists, "is not empty", nil},
		// R23.2: only the secret's holder can make an archive restore
		// takes; one without a MAC needs --unauthenticated.
		{"database edited, manifest recomputed", editDB(t, good), "", errs.InvalidArgument, "does not verify under BETTER_COMPUTE_SECRET", nil},
		{"manifest edited", reseal(t, good, nil, func(name string, b []byte) []byte {
			if name == "manifest.json" {
				return editJSON(t, b, func(m map[string]any) { m["trustDomain"] = "evil.test" })
			}
			return b
		}), "", errs.InvalidArgument, "does not verify under BETTER_COMPUTE_SECRET", nil},
		{"another secret", good, "", errs.InvalidArgument, "does not verify under BETTER_COMPUTE_SECRET", []byte("another secret entirely, 0123456789abcdef")},
		{"no secret", good, "", errs.InvalidConfig, "BETTER_COMPUTE_SECRET is not set", []byte{}},
		{"MAC stripped", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "manifest.mac" {
				return nil
			}
			return b
		}), "", errs.InvalidArgument, "carries no MAC", nil},
		{"MAC garbled", rewrite(t, good, func(name string, b []byte) []byte {
			if name == "manifest.mac" {
				return []byte("{}")
			}
			return b
		}), "", errs.InvalidArgument, "not a MAC this binary knows", nil},
		{"older format", unauthenticated(t, good), "", errs.InvalidArgument, "--unauthenticated", nil},
		// R23.2: sizes are bounded before anything is written.
		{"PKI file too large", editManifest(t, good, func(m map[string]any) {
			for _, f := range m["files"].([]any) {
				if f := f.(map[string]any); f["name"] == "pki/bundle.json" {
					f["size"] = 2 << 20
				}
			}
		}), "", errs.InvalidArgument, "a PKI file is at most", nil},
		{"more than the free space", editManifest(t, good, func(m map[string]any) {
			for _, f := range m["files"].([]any) {
				if f := f.(map[string]any); f["name"] == "db/bc.db" {
					f["size"] = int64(1) << 49
				}
			}
		}), "", errs.InvalidState, "free space", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := tc.dir
			if dir == "" {
				dir = filepath.Join(parent, "restored")
			}
			auth := auth
			if tc.secret != nil {
				auth.Secret = tc.secret
			}
			_, err := backup.Restore(context.Background(), backup.RestoreConfig{In: tc.in, DataDir: dir, Auth: auth})
			wantErr(t, err, tc.code, tc.msg)
			if tc.dir == "" {
				if ents, _ := os.ReadDir(parent); len(ents) != 0 {
					t.Errorf("a refused restore left %v", ents)
				}
			} else if b, _ := os.ReadFile(filepath.Join(dir, "bc.db")); string(b) != "someone's" {
				t.Errorf("a refused restore changed the target: %q", b)
			}
			if tc.code == errs.InvalidArgument || tc.code == errs.InvalidState {
				if _, err := backup.Verify(context.Background(), tc.in, auth); !errs.Is(err, tc.code) {
					t.Errorf("Verify = %v, want %s", err, tc.code)
				}
			}
		})
	}
	if _, err := backup.Verify(context.Background(), good, auth); err != nil {
		t.Errorf("Verify of a good archive: %v", err)
	}
}

// R16.3: an empty directory is a fresh target; --keep-tokens keeps the
// backup's tokens live.
func TestRestoreEmptyDirKeepTokens(t *testing.T) {
	good, tok := takeBackup(t)
	dir := t.TempDir()
	res, err := backup.Restore(context.Background(), backup.RestoreConfig{In: good, DataDir: dir, KeepTokens: true, Auth: auth})
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

// R23.2: an archive of an older release (no MAC) restores only with
// Unauthenticated, and says so; a current archive stripped of its MAC is
// refused even then, and one with a MAC must verify even then.
func TestRestoreUnauthenticatedR23_2(t *testing.T) {
	good, _ := takeBackup(t)
	old := unauthenticated(t, good)
	loose := backup.Auth{Unauthenticated: true}
	res, err := backup.Restore(context.Background(), backup.RestoreConfig{In: old, DataDir: filepath.Join(t.TempDir(), "r"), Auth: loose})
	if err != nil || res.Authenticated {
		t.Fatalf("restore of an older archive with Unauthenticated: %+v, %v", res.Authenticated, err)
	}
	if v, err := backup.Verify(context.Background(), old, loose); err != nil || v.Authenticated {
		t.Fatalf("verify of an older archive with Unauthenticated: %+v, %v", v.Authenticated, err)
	}
	stripped := rewrite(t, good, func(name string, b []byte) []byte {
		if name == "manifest.mac" {
			return nil
		}
		return b
	})
	_, err = backup.Restore(context.Background(), backup.RestoreConfig{In: stripped, DataDir: filepath.Join(t.TempDir(), "r"), Auth: loose})
	wantErr(t, err, errs.InvalidArgument, "a format 2 manifest without manifest.mac")
	_, err = backup.Restore(context.Background(), backup.RestoreConfig{In: editDB(t, good), DataDir: filepath.Join(t.TempDir(), "r"),
		Auth: backup.Auth{Secret: testSecret, Unauthenticated: true}})
	wantErr(t, err, errs.InvalidArgument, "does not verify")
	if v, err := backup.Verify(context.Background(), good, auth); err != nil || !v.Authenticated {
		t.Fatalf("verify of a current archive: %+v, %v", v.Authenticated, err)
	}
}
