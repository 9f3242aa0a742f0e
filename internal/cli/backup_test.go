package cli_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// R16.3: backup and restore from the command line, on serve's config: a
// summary on stdout (or --json), progress on stderr, and the R3.6 error
// form for an existing --out and a non-empty --data-dir.
func TestBackupRestoreCommands(t *testing.T) {
	base := t.TempDir()
	env := map[string]string{"BETTER_COMPUTE_SECRET": "lH3f2xq0m1U8cYt7bVQ2r9nK5sJwE6aZpD4gL0oTyXc"}
	pkiDir := filepath.Join(base, "pki")
	run(t, env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", pkiDir).ok(t)
	dbPath := filepath.Join(base, "bc.db")
	db, err := store.Open(context.Background(), store.Config{Path: dbPath}, nil)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	cfg := filepath.Join(base, "config.toml")
	toml := fmt.Sprintf("[store]\npath = %q\n[pki]\ndir = %q\n", dbPath, pkiDir)
	if err := os.WriteFile(cfg, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}

	out := filepath.Join(base, "bc.backup")
	r := run(t, env, "backup", "--config", cfg, "--out", out, "--json").ok(t)
	var m struct {
		Format        int    `json:"format"`
		SchemaVersion int64  `json:"schemaVersion"`
		TrustDomain   string `json:"trustDomain"`
		Files         []struct{ Name string }
	}
	if err := json.Unmarshal([]byte(r.stdout), &m); err != nil {
		t.Fatalf("--json: %v\n%s", err, r.stdout)
	}
	known, _ := store.KnownSchemaVersion(store.SQLite)
	if m.Format != backup.Format || m.SchemaVersion != known || m.TrustDomain != "compute.example.com" || len(m.Files) < 5 {
		t.Errorf("manifest %+v", m)
	}
	if !strings.Contains(r.stderr, "copying the database") || !strings.Contains(r.stderr, "keep it apart") {
		t.Errorf("progress %q", r.stderr)
	}
	run(t, env, "backup", "--config", cfg, "--out", out).fails(t, "ALREADY_EXISTS", "never overwrites")
	run(t, env, "backup", "--config", cfg).fails(t, "INVALID_ARGUMENT", "--out")
	// R24.1: a missing directory is refused with a code and the fix.
	run(t, env, "backup", "--config", cfg, "--out", filepath.Join(base, "no-such-dir", "bc.backup")).fails(t, "INVALID_ARGUMENT", "does not exist: create it first")
	run(t, env, "backup", "--config", cfg, "--data-dir", base, "--out", out+"2").fails(t, "INVALID_ARGUMENT", "not both")
	// A data directory as dev and restore lay it out: bc.db and pki/.
	r = run(t, env, "backup", "--data-dir", base, "--out", out+"2").ok(t)
	if !strings.Contains(r.stdout, fmt.Sprintf("schema version %d", known)) {
		t.Errorf("backup --data-dir: %q", r.stdout)
	}
	if r = run(t, env, "restore", "--known-schema").ok(t); r.stdout != fmt.Sprintf("%d\n", known) {
		t.Errorf("--known-schema = %q, want %d", r.stdout, known)
	}

	r = run(t, env, "restore", "--in", out, "--verify").ok(t)
	if !strings.Contains(r.stdout, "the archive is authenticated under BETTER_COMPUTE_SECRET and matches its manifest") || !strings.Contains(r.stdout, fmt.Sprintf("this binary knows up to %d", known)) {
		t.Errorf("--verify: %q", r.stdout)
	}
	dir := filepath.Join(base, "restored")
	r = run(t, env, "restore", "--in", out, "--data-dir", dir).ok(t)
	for _, want := range []string{"revoked 0 join tokens", "store.path = " + fmt.Sprintf("%q", filepath.Join(dir, "bc.db")), "joined after it", "--allow-reclaim"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("restore output lacks %q:\n%s", want, r.stdout)
		}
	}
	run(t, env, "restore", "--in", out, "--data-dir", dir).fails(t, "ALREADY_EXISTS", "is not empty")
	r = run(t, env, "restore", "--in", out, "--data-dir", filepath.Join(base, "second"), "--json").ok(t)
	var s struct {
		DBPath        string   `json:"dbPath"`
		RevokedTokens []string `json:"revokedTokens"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &s); err != nil || s.DBPath != filepath.Join(base, "second", "bc.db") || s.RevokedTokens == nil {
		t.Errorf("restore --json %+v (%v):\n%s", s, err, r.stdout)
	}
}

// R23.2: restore and restore --verify take only an archive that verifies
// under BETTER_COMPUTE_SECRET; an archive without a MAC (an older
// release's) needs --unauthenticated and draws a warning on stderr.
func TestRestoreAuthenticatesR23_2(t *testing.T) {
	base := t.TempDir()
	secret := "lH3f2xq0m1U8cYt7bVQ2r9nK5sJwE6aZpD4gL0oTyXc"
	env := map[string]string{"BETTER_COMPUTE_SECRET": secret}
	run(t, env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", filepath.Join(base, "pki")).ok(t)
	db, err := store.Open(context.Background(), store.Config{Path: filepath.Join(base, "bc.db")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	out := filepath.Join(base, "bc.backup")
	run(t, nil, "backup", "--data-dir", base, "--out", out).fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET is not set")
	run(t, env, "backup", "--data-dir", base, "--out", out).ok(t)

	run(t, nil, "restore", "--in", out, "--verify").fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET is not set")
	other := map[string]string{"BETTER_COMPUTE_SECRET": "Zz9" + secret[3:]}
	run(t, other, "restore", "--in", out, "--verify").fails(t, "INVALID_ARGUMENT", "does not verify under BETTER_COMPUTE_SECRET")
	// A restore prints its progress line first, then the error.
	refused := func(r result, want string) {
		t.Helper()
		if r.code != 1 || !strings.Contains(r.stderr, "Error: INVALID_ARGUMENT: ") || !strings.Contains(r.stderr, want) {
			t.Errorf("exit %d, want a refusal with %q:\n%s", r.code, want, r.stderr)
		}
	}
	refused(run(t, other, "restore", "--in", out, "--data-dir", filepath.Join(base, "r1")), "does not verify")
	old := olderArchive(t, out)
	refused(run(t, env, "restore", "--in", old, "--data-dir", filepath.Join(base, "r2")), "--unauthenticated")
	r := run(t, nil, "restore", "--in", old, "--data-dir", filepath.Join(base, "r3"), "--unauthenticated", "--json").ok(t)
	if !strings.Contains(r.stderr, "WARNING: this archive carries no MAC") || !strings.Contains(r.stdout, `"authenticated": false`) {
		t.Errorf("restore --unauthenticated:\nstdout: %s\nstderr: %s", r.stdout, r.stderr)
	}
	r = run(t, env, "restore", "--in", out, "--data-dir", filepath.Join(base, "r4")).ok(t)
	if strings.Contains(r.stderr, "WARNING") || !strings.Contains(r.stderr, "MAC and checksums match") {
		t.Errorf("restore of an authenticated archive:\n%s", r.stderr)
	}
}

// olderArchive rewrites the archive at in as an older release wrote it:
// format 1, no manifest.mac.
func olderArchive(t *testing.T, in string) string {
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
		switch h.Name {
		case "manifest.mac":
			continue
		case "manifest.json":
			b = bytes.Replace(b, []byte(`"format": 2`), []byte(`"format": 1`), 1)
		}
		h.Size = int64(len(b))
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(tw.Close(), zw.Close()); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "older.backup")
	if err := os.WriteFile(out, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return out
}
