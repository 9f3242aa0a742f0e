package rotation_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var secret = []byte("rotation-test-secret-of-enough-length-0123456789")

type fixture struct {
	db   *store.DB
	base *ca.Bundle
	ring *rotation.Ring
	now  time.Time
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	base, err := ca.Generate("compute.example.com", now)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.InsertTenant(ctx, "tn_root", "root"); err != nil {
			return err
		}
		return tx.SetRootTenantID(ctx, "tn_root")
	}); err != nil {
		t.Fatal(err)
	}
	ring, err := rotation.Open(ctx, rotation.Config{DB: db, Base: base, Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	return &fixture{db: db, base: base, ring: ring, now: now}
}

func (f *fixture) rotate(t *testing.T, kind, phase string) rotation.Result {
	t.Helper()
	res, err := rotation.Rotate(context.Background(), f.db, f.base, secret, rotation.Op{Kind: kind, Phase: phase, Actor: "cli:test", Now: f.now})
	if err != nil {
		t.Fatalf("%s %s: %v", kind, phase, err)
	}
	if _, err := f.ring.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	return res
}

func pinOf(t *testing.T, kind string, b *ca.Bundle) string {
	t.Helper()
	der, _ := b.KeyOf(kind)
	pub, _, err := ca.PublicKeyOfDER(kind, der)
	if err != nil {
		t.Fatal(err)
	}
	p, err := pki.Pin(pub)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// R16.1: each phase of every kind moves what signs and what is accepted,
// and the holder of the startup bundle sees it without being rebuilt.
func TestPhasesEveryKindR16_1(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		f := newFixture(t, db)
		for _, kind := range ca.Kinds {
			before := f.base.Now()
			oldPin := pinOf(t, kind, before)

			prep := f.rotate(t, kind, rotation.PhasePrepare)
			b := f.base.Now()
			if prep.Gen != 2 || prep.Current != 1 || pinOf(t, kind, b) != oldPin {
				t.Fatalf("%s prepare: %+v; the current key must still sign", kind, prep)
			}
			if n := accepted(kind, b); n != 2 && kind != ca.KindJoinSigning {
				t.Fatalf("%s prepare: %d keys accepted, want current and next", kind, n)
			}

			act := f.rotate(t, kind, rotation.PhaseActivate)
			b = f.base.Now()
			if act.Current != 2 || pinOf(t, kind, b) != prep.Fingerprint {
				t.Fatalf("%s activate: %+v, signing pin %s want %s", kind, act, pinOf(t, kind, b), prep.Fingerprint)
			}
			if n := accepted(kind, b); n != 2 && kind != ca.KindJoinSigning {
				t.Fatalf("%s activate: %d keys accepted, want new and previous", kind, n)
			}

			f.rotate(t, kind, rotation.PhaseRetire)
			b = f.base.Now()
			if n := accepted(kind, b); n != 1 || pinOf(t, kind, b) != prep.Fingerprint {
				t.Fatalf("%s retire: %d accepted (want 1), pin %s", kind, n, pinOf(t, kind, b))
			}
		}
		// Every phase wrote its event and audit row (on PostgreSQL an event
		// is readable once the sequencer numbered it).
		want := 3 * len(ca.Kinds)
		var evs []store.Event
		var aud []store.AuditEntry
		poll.UntilDetail(t, 10*time.Second, func() string {
			return fmt.Sprintf("%d events and %d audit rows, want %d of each", len(evs), len(aud), want)
		}, func() bool {
			if err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
				var err error
				if evs, err = tx.ListEvents(context.Background(), "tn_root", 0, 0, "pki.key.", 1000); err != nil {
					return err
				}
				aud, err = tx.ListAudit(context.Background(), "tn_root", 0, 1000)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return len(evs) == want && len(aud) == want
		})
	})
}

func accepted(kind string, b *ca.Bundle) int {
	switch kind {
	case ca.KindNodeCA:
		return len(b.TrustedNodeCAs())
	case ca.KindServingCA:
		return len(b.TrustedServingCAs())
	case ca.KindCommandSigning:
		return len(b.CommandBundle())
	case ca.KindJoinEncryption:
		return len(b.OpeningKeys())
	}
	// join-signing: only the current key signs; daemons accept by pin.
	return 1
}

// R16.2: the statements a replica hands out take a daemon that pins
// generation 1 to generation 3 through two rotations, drop the retired
// keys, and a rollback's statement takes back a key it had learned.
func TestStatementsChainR16_2(t *testing.T) {
	f := newFixture(t, storetest.OpenSQLite(t))
	kind := ca.KindJoinSigning
	pins := []string{pinOf(t, kind, f.base)}
	var third string
	for i := 0; i < 2; i++ {
		f.rotate(t, kind, rotation.PhasePrepare)
		third = f.rotate(t, kind, rotation.PhaseActivate).Fingerprint
		f.rotate(t, kind, rotation.PhaseRetire)
	}
	got, change := pki.ApplyStatements(kind, pins, nil, f.base.Now().KeyStatements)
	if len(got) != 1 || got[0] != third || !change.Changed() {
		t.Fatalf("pins %v after two rotations, want [%s]", got, third)
	}

	// Prepared, learned by a daemon, then rolled back from activate.
	prep := f.rotate(t, kind, rotation.PhasePrepare)
	learned, _ := pki.ApplyStatements(kind, got, nil, f.base.Now().KeyStatements)
	if len(learned) != 2 || learned[1] != prep.Fingerprint {
		t.Fatalf("pins %v after prepare, want the next one added", learned)
	}
	f.rotate(t, kind, rotation.PhaseActivate)
	f.rotate(t, kind, rotation.PhaseRollback)
	if pinOf(t, kind, f.base.Now()) != third {
		t.Fatal("rollback from activate: the previous key must sign again")
	}
	after, _ := pki.ApplyStatements(kind, learned, nil, f.base.Now().KeyStatements)
	if len(after) != 1 || after[0] != third {
		t.Fatalf("pins %v after the rollback, want only %s", after, third)
	}
	// And it can be prepared again.
	f.rotate(t, kind, rotation.PhasePrepare)
}

// R16.1: phases out of order are refused and change nothing.
func TestPhaseOrderR16_1(t *testing.T) {
	f := newFixture(t, storetest.OpenSQLite(t))
	cases := []struct {
		setup []string
		phase string
	}{
		{nil, rotation.PhaseActivate},
		{nil, rotation.PhaseRetire},
		{nil, rotation.PhaseRollback},
		{[]string{rotation.PhasePrepare}, rotation.PhasePrepare},
		{[]string{rotation.PhaseActivate}, rotation.PhasePrepare},
	}
	for _, tc := range cases {
		for _, p := range tc.setup {
			f.rotate(t, ca.KindServingCA, p)
		}
		_, err := rotation.Rotate(context.Background(), f.db, f.base, secret, rotation.Op{Kind: ca.KindServingCA, Phase: tc.phase, Now: f.now})
		if e, ok := errs.As(err); !ok || e.Code != errs.InvalidState {
			t.Fatalf("%v then %s: %v, want INVALID_STATE", tc.setup, tc.phase, err)
		}
	}
	for _, op := range []rotation.Op{{Kind: "root-ca", Phase: rotation.PhasePrepare}, {Kind: ca.KindNodeCA, Phase: "flip"}} {
		if _, err := rotation.Rotate(context.Background(), f.db, f.base, secret, op); errs.CodeOf(err) != errs.InvalidArgument {
			t.Fatalf("%+v: %v, want INVALID_ARGUMENT", op, err)
		}
	}
}

// R16.1: another replica (its own Ring on the same database) follows a
// phase the CLI wrote, and a database of another PKI directory is refused.
func TestReplicasAgreeR16_1(t *testing.T) {
	db := storetest.OpenSQLite(t)
	f := newFixture(t, db)
	other, err := rotation.Open(context.Background(), rotation.Config{DB: db, Base: copyBundle(t, f.base), Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	res := f.rotate(t, ca.KindNodeCA, rotation.PhasePrepare)
	if changed, err := other.Reload(context.Background()); err != nil || !changed {
		t.Fatalf("reload: %v %v", changed, err)
	}
	if n := len(other.Current().TrustedNodeCAs()); n != 2 {
		t.Fatalf("the other replica accepts %d node CAs, want 2 (gen %d prepared)", n, res.Gen)
	}
	stranger, err := ca.Generate("compute.example.com", f.now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rotation.Open(context.Background(), rotation.Config{DB: db, Base: stranger, Secret: secret}); errs.CodeOf(err) != errs.InvalidConfig {
		t.Fatalf("another PKI directory on this database: %v, want INVALID_CONFIG", err)
	}
}

// copyBundle is the same PKI directory as another replica loads it.
func copyBundle(t *testing.T, b *ca.Bundle) *ca.Bundle {
	t.Helper()
	c := &ca.Bundle{TrustDomain: b.TrustDomain, CreatedAt: b.CreatedAt,
		NodeCA: b.NodeCA, NodeCAKey: b.NodeCAKey, ServingCA: b.ServingCA, ServingCAKey: b.ServingCAKey,
		CommandSigningCert: b.CommandSigningCert, CommandSigningKey: b.CommandSigningKey,
		JoinSigningCert: b.JoinSigningCert, JoinSigningKey: b.JoinSigningKey, JoinEncryptionKey: b.JoinEncryptionKey}
	if _, err := x509.ParseCertificate(c.NodeCA.Raw); err != nil {
		t.Fatal(err)
	}
	return c
}
