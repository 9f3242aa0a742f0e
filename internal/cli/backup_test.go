package cli_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

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
	if m.Format != 1 || m.SchemaVersion != known || m.TrustDomain != "compute.example.com" || len(m.Files) < 5 {
		t.Errorf("manifest %+v", m)
	}
	if !strings.Contains(r.stderr, "copying the database") || !strings.Contains(r.stderr, "keep it apart") {
		t.Errorf("progress %q", r.stderr)
	}
	run(t, env, "backup", "--config", cfg, "--out", out).fails(t, "ALREADY_EXISTS", "never overwrites")
	run(t, env, "backup", "--config", cfg).fails(t, "INVALID_ARGUMENT", "--out")
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
	if !strings.Contains(r.stdout, "the archive matches its manifest") || !strings.Contains(r.stdout, fmt.Sprintf("this binary knows up to %d", known)) {
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
