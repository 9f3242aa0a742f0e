package backup_test

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// held is a node as bcd holds it: its machine, key and chain.
type held struct {
	id    string
	m     *jointest.Machine
	chain [][]byte
}

func (p *plane) join(t testing.TB, m *jointest.Machine, token string) *held {
	t.Helper()
	res, err := p.srv.Join().Join(context.Background(), m.Request(t, p.bundle, token, ""), joinPeer)
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	j := m.Verify(t, p.bundle, res, pki.RoleNode)
	return &held{id: j.Body.NodeId, m: m, chain: j.Body.CertChain}
}

func (p *plane) renew(t testing.TB, h *held) (*held, error) {
	t.Helper()
	req, next := jointest.RenewRequest(t, h.m.Key, h.chain, h.id, time.Now())
	res, err := p.srv.Join().Renew(context.Background(), req, join.Peer{Addr: joinPeer.Addr, Cert: h.chain[0]})
	if err != nil {
		return nil, err
	}
	j := next.VerifyRenewal(t, p.bundle, res, pki.RoleNode)
	next.Claims = h.m.Claims
	return &held{id: h.id, m: next, chain: j.Body.CertChain}, nil
}

// R16.3, R13.2, R10.5, R15.3: what a restore means for machines that
// changed after the backup. Their certificates chain to the restored node
// CA, but are not node_certs rows of the restored database, and a
// certificate is trusted only as a stored row (nodeident.Check), never
// because it chains to the CA:
//   - a machine that joined after the backup is refused renewal and an
//     x509pop re-join (cert-unknown); the use it spent is not spendable
//     again (its token is revoked); it joins again with a new token, as a
//     new node;
//   - a machine that renewed after the backup is refused the same way (its
//     node's stored certificate is the one before, whose key the machine
//     replaced); a new token takes it back only with allowReclaim (the
//     R15.3 reclaim of its trusted hardware key), as the same node, which
//     then renews.
func TestMachinesChangedAfterBackup(t *testing.T) {
	ctx := context.Background()
	p := newPlane(t)
	pool := p.pool(t)
	renewer := p.join(t, jointest.NewMachine(t, jointest.Claims(1)), p.token(t, pool.Id, 1, false).Token)
	later := p.token(t, pool.Id, 2, false)

	out := filepath.Join(t.TempDir(), "bc.backup")
	if _, err := backup.Create(ctx, backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: out, Secret: testSecret}); err != nil {
		t.Fatal(err)
	}
	joiner := p.join(t, jointest.NewMachine(t, jointest.Claims(2)), later.Token)
	renewed, err := p.renew(t, renewer)
	if err != nil {
		t.Fatalf("renew before the restore: %v", err)
	}

	dir := filepath.Join(t.TempDir(), "restored")
	res, err := backup.Restore(ctx, backup.RestoreConfig{In: out, DataDir: dir, Auth: auth})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.RevokedTokens) != 1 || res.RevokedTokens[0].ID != later.Id || res.RevokedTokens[0].UsesLeft != 2 {
		t.Fatalf("revoked %+v, want %s with its 2 uses of the backup", res.RevokedTokens, later.Id)
	}
	r := restorePlane(t, dir)
	if got := r.nodes(t); len(got) != 1 || got[0].ID != renewer.id {
		t.Fatalf("restored nodes %v, want only %s", got, renewer.id)
	}

	// The machine that joined after the backup.
	_, err = r.renew(t, joiner)
	jointest.WantRenewRefused(t, err)
	popM := jointest.NewMachine(t, joiner.m.Claims)
	_, err = r.srv.Join().Join(ctx, popM.X509PopRequest(t, joiner.m.Key, joiner.chain, joiner.id, time.Now()), joinPeer)
	jointest.WantRefused(t, err)
	_, err = r.srv.Join().Join(ctx, jointest.NewMachine(t, joiner.m.Claims).Request(t, r.bundle, later.Token, ""), joinPeer)
	jointest.WantRefused(t, err)
	again := r.join(t, jointest.NewMachine(t, joiner.m.Claims), r.token(t, pool.Id, 1, false).Token)
	if again.id == joiner.id {
		t.Errorf("the re-joined machine is node %s again, want a new node", again.id)
	}
	if _, err := r.renew(t, again); err != nil {
		t.Errorf("the re-joined machine's renewal: %v", err)
	}

	// The machine that renewed after the backup.
	_, err = r.renew(t, renewed)
	jointest.WantRenewRefused(t, err)
	_, err = r.srv.Join().Join(ctx, jointest.NewMachine(t, renewer.m.Claims).Request(t, r.bundle, r.token(t, pool.Id, 1, false).Token, ""), joinPeer)
	jointest.WantRefused(t, err)
	back := r.join(t, jointest.NewMachine(t, renewer.m.Claims), r.token(t, pool.Id, 1, true).Token)
	if back.id != renewer.id {
		t.Errorf("the reclaimed machine is node %s, want %s", back.id, renewer.id)
	}
	if _, err := r.renew(t, back); err != nil {
		t.Errorf("the reclaimed node's renewal: %v", err)
	}

	renewReasons := []string{}
	for _, rr := range jointest.RenewRefusals(t, r.db, r.root) {
		renewReasons = append(renewReasons, rr.Reason)
	}
	if want := []string{"cert-unknown", "cert-unknown"}; !slices.Equal(renewReasons, want) {
		t.Errorf("renew refusals %v, want %v", renewReasons, want)
	}
	if got, want := jointest.Reasons(t, r.db, r.root), []string{"x509pop:cert-unknown", "join-token:token-revoked", "join-token:reclaim"}; !slices.Equal(got, want) {
		t.Errorf("join refusals %v, want %v", got, want)
	}
}

// R24.1: a node connected when the backup was taken is disconnected in
// the restored database: no process holds that session any more, and the
// API showed it connected for minutes.
func TestRestoreDisconnectsNodesR24_1(t *testing.T) {
	ctx := context.Background()
	p := newPlane(t)
	pool := p.pool(t)
	m := p.join(t, jointest.NewMachine(t, jointest.Claims(1)), p.token(t, pool.Id, 1, false).Token)
	if err := p.db.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.ConnectNode(ctx, m.id, "sess_backup")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got := p.nodes(t); len(got) != 1 || got[0].Connection != store.Connected {
		t.Fatalf("before the backup: %+v", got)
	}
	out := filepath.Join(t.TempDir(), "bc.backup")
	if _, err := backup.Create(ctx, backup.Config{Store: store.Config{Path: p.dbPath}, PKIDir: p.pkiDir, Out: out, Secret: testSecret}); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "restored")
	if _, err := backup.Restore(ctx, backup.RestoreConfig{In: out, DataDir: dir, Auth: auth}); err != nil {
		t.Fatal(err)
	}
	if got := restorePlane(t, dir).nodes(t); len(got) != 1 || got[0].Connection != store.Disconnected {
		t.Fatalf("restored nodes %+v, want the one node disconnected", got)
	}
}
