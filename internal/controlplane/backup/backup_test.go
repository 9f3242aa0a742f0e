package backup_test

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R16.3: a backup taken while machines keep joining through the agent
// listener restores into a fresh directory that serves: the schema is
// this binary's, every node the copy holds has its certificate (the copy
// is one consistent snapshot), the operator API lists the nodes, and the
// token the joins spent is revoked, with its event and audit rows.
func TestBackupDuringJoinsRestores(t *testing.T) {
	ctx := context.Background()
	p := newPlane(t)
	pool := p.pool(t)
	const workers, perWorker = 6, 10
	tok := p.token(t, pool.Id, workers*perWorker+10, false)

	var joined atomic.Int64
	started := make(chan struct{})
	var wg sync.WaitGroup
	errc := make(chan error, workers*perWorker)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWorker {
				m := jointest.NewMachine(t, jointest.Claims(1000+w*perWorker+i))
				res, err := p.agent.Join(ctx, connect.NewRequest(m.Request(t, p.bundle, tok.Token, "")))
				if err != nil {
					errc <- err
					return
				}
				if len(res.Msg.GetBody()) == 0 {
					t.Error("join answered without a body")
				}
				if joined.Add(1) == workers {
					close(started)
				}
			}
		}()
	}
	<-started
	out := filepath.Join(t.TempDir(), "bc.backup")
	var lines []string
	before := joined.Load()
	m, err := backup.Create(ctx, backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: out, Secret: testSecret,
		Progress: func(f string, _ ...any) { lines = append(lines, f) }})
	atBackup := joined.Load()
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Errorf("join: %v", err)
	}
	if err != nil {
		t.Fatalf("backup: %v", err)
	}
	if len(lines) == 0 {
		t.Error("backup reported no progress")
	}
	known, _ := store.KnownSchemaVersion(store.SQLite)
	if m.Format != backup.Format || m.SchemaVersion != known || m.Store != "sqlite" || m.TrustDomain != "backup.test" {
		t.Errorf("manifest %+v", m)
	}
	checkArchive(t, out)

	dir := filepath.Join(t.TempDir(), "restored")
	res, err := backup.Restore(ctx, backup.RestoreConfig{In: out, DataDir: dir, Auth: auth})
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	if len(res.RevokedTokens) != 1 || res.RevokedTokens[0].ID != tok.Id {
		t.Fatalf("revoked %+v, want %s", res.RevokedTokens, tok.Id)
	}
	// Joins are counted once answered: every one counted before the
	// backup began is in it, and none answered after it ended, but for
	// those in flight.
	if res.Nodes < before || res.Nodes > atBackup+workers {
		t.Errorf("restored %d nodes; %d had joined when the backup began, %d when it ended", res.Nodes, before, atBackup)
	}
	t.Logf("restored %d nodes: %d joined before the backup, %d by its end, %d in all", res.Nodes, before, atBackup, workers*perWorker)
	if res.DBPath != filepath.Join(dir, "bc.db") || res.PKIDir != filepath.Join(dir, "pki") || res.SchemaVersion != known {
		t.Errorf("restored %+v", res)
	}

	r := restorePlane(t, dir)
	if v, err := r.db.SchemaVersion(ctx); err != nil || v != known {
		t.Errorf("restored schema %d, %v; want %d", v, err, known)
	}
	list, err := r.admin.Nodes.ListNodes(ctx, connect.NewRequest(&bcv1.ListNodesRequest{TenantId: r.root, PageSize: 1000}))
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(list.Msg.Items)) != res.Nodes {
		t.Errorf("ListNodes = %d nodes, restore said %d", len(list.Msg.Items), res.Nodes)
	}
	for _, n := range r.nodes(t) {
		var certs []store.NodeCert
		if err := r.db.ReadTx(ctx, func(tx *store.Tx) (err error) { certs, err = tx.ListNodeCerts(ctx, n.ID, 10); return }); err != nil || len(certs) != 1 {
			t.Errorf("node %s: %d certificates (%v), want its one", n.ID, len(certs), err)
		}
	}
	if j := r.tokenRow(t, tok.Id); j.Live || j.RevokedAt == nil {
		t.Errorf("restored token %+v, want revoked", j)
	}
	// The token's uses left in the copy are not spendable.
	m2 := jointest.NewMachine(t, jointest.Claims(9999))
	_, err = r.srv.Join().Join(ctx, m2.Request(t, r.bundle, tok.Token, ""), joinPeer)
	jointest.WantRefused(t, err)

	checkRecorded(t, r, tok.Id)
}

// checkRecorded checks what the restore wrote into the restored database:
// a controlplane.restored audit row, and the token's revocation audited and
// announced.
func checkRecorded(t *testing.T, r *plane, tokenID string) {
	t.Helper()
	ctx := context.Background()
	var actions []string
	err := r.db.ReadTx(ctx, func(tx *store.Tx) error {
		rows, err := tx.ListAudit(ctx, r.root, 0, 100)
		for _, a := range rows {
			actions = append(actions, a.Action)
		}
		return err
	})
	if err != nil || !slices.Contains(actions, "controlplane.restored") || !slices.Contains(actions, "join-token.revoked") {
		t.Errorf("audit actions %v (%v), want controlplane.restored and join-token.revoked", actions, err)
	}
	if err := r.db.WaitEventsVisible(ctx, r.root, 0); err != nil {
		t.Fatal(err)
	}
	err = r.db.ReadTx(ctx, func(tx *store.Tx) error {
		evs, err := tx.ListEvents(ctx, r.root, 0, 0, "security.join-token.revoked", 10)
		if err == nil && (len(evs) != 1 || evs[0].Subject != tokenID) {
			t.Errorf("revocation events %+v", evs)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// checkArchive checks what the archive holds: 0600, the manifest first,
// the database and PKI files, every key encrypted, and never the secret.
func checkArchive(t *testing.T, path string) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("archive %v, %v; want mode 0600", fi, err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var names []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(b, testSecret) {
			t.Errorf("%s holds the secret", h.Name)
		}
		if filepath.Ext(h.Name) == ".key" && !bytes.Contains(b, []byte("BETTER-COMPUTE ENCRYPTED PRIVATE KEY")) {
			t.Errorf("%s is not an encrypted key", h.Name)
		}
	}
	for _, want := range []string{"manifest.json", "db/bc.db", "pki/bundle.json", "pki/node-ca.crt", "pki/node-ca.key", "pki/join-encryption.jwk"} {
		if !slices.Contains(names, want) {
			t.Errorf("archive members %v lack %s", names, want)
		}
	}
	if len(names) == 0 || names[0] != "manifest.json" {
		t.Errorf("first member of %v, want manifest.json", names)
	}
}

// R16.3: --out is never overwritten, PostgreSQL is refused with a pointer
// to its runbook, and a key in the clear is never put in an archive.
func TestBackupRefusals(t *testing.T) {
	ctx := context.Background()
	p := newPlane(t)
	exists := filepath.Join(t.TempDir(), "exists")
	if err := os.WriteFile(exists, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	clear := t.TempDir()
	for _, name := range []string{"bundle.json", "node-ca.crt"} {
		b, _ := os.ReadFile(filepath.Join(p.pkiDir, name))
		_ = os.WriteFile(filepath.Join(clear, name), b, 0o644)
	}
	_ = os.WriteFile(filepath.Join(clear, "node-ca.key"), []byte("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n"), 0o600)
	for _, tc := range []struct {
		name string
		cfg  backup.Config
		code errs.Code
		msg  string
	}{
		{"out exists", backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: exists}, errs.AlreadyExists, "a backup never overwrites a file"},
		{"postgres", backup.Config{Store: store.Config{Driver: "postgres", DSN: "postgres://db/bc"}, Out: filepath.Join(t.TempDir(), "pg"), Secret: testSecret}, errs.InvalidState, "pg_dump"},
		{"clear key", backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: clear, Out: filepath.Join(t.TempDir(), "clear"), Secret: testSecret}, errs.InvalidState, "refusing to put a key in the clear"},
		// R23.2: the archive is authenticated under the secret, so none is
		// written without it.
		{"no secret", backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: filepath.Join(t.TempDir(), "nosecret")}, errs.InvalidConfig, "BETTER_COMPUTE_SECRET is not set"},
		{"no out", backup.Config{Store: store.Config{Path: p.dbPath}}, errs.InvalidArgument, "required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := backup.Create(ctx, tc.cfg)
			wantErr(t, err, tc.code, tc.msg)
			if tc.cfg.Out != "" && tc.cfg.Out != exists {
				if _, err := os.Stat(tc.cfg.Out); err == nil {
					t.Error("a refused backup left its archive")
				}
				if ents, _ := os.ReadDir(filepath.Dir(tc.cfg.Out)); len(ents) != 0 {
					t.Errorf("a refused backup left %v", ents)
				}
			}
		})
	}
	if b, _ := os.ReadFile(exists); string(b) != "keep me" {
		t.Errorf("--out was overwritten: %q", b)
	}
}

func wantErr(t testing.TB, err error, code errs.Code, msg string) {
	t.Helper()
	if !errs.Is(err, code) || !bytes.Contains([]byte(errs.MessageOf(err)), []byte(msg)) {
		t.Fatalf("err = %v, want %s containing %q", err, code, msg)
	}
}
