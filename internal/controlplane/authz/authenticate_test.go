package authz

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// keys makes a tenant with a live key and a revoked key and returns their
// bearers, a bearer whose id is unknown, and a known id with a wrong secret.
func keys(t testing.TB, db *store.DB) (live, revoked, unknownID, wrongSecret string) {
	t.Helper()
	ctx := context.Background()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		tn, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "acme-"+ids.New("x", now))
		if err != nil {
			return err
		}
		if _, live, err = NewKey(ctx, tx, tn.ID, "live", Admin, 0, now); err != nil {
			return err
		}
		k, b, err := NewKey(ctx, tx, tn.ID, "revoked", Admin, 0, now)
		if err != nil {
			return err
		}
		revoked = b
		_, err = tx.RevokeAPIKey(ctx, tn.ID, k.ID)
		return err
	})
	if err != nil {
		t.Fatalf("keys: %v", err)
	}
	id, _, _ := secret.Parse(KeyScheme, live)
	other, _ := secret.Mint()
	unknownID = secret.Format(KeyScheme, ids.New(ids.APIKey, time.Now()), other)
	wrongSecret = secret.Format(KeyScheme, id, other)
	return live, revoked, unknownID, wrongSecret
}

// R1.2, R15.4: authentication does the same work whatever is wrong with a
// key. An unknown key id is verified (against a fixed hash) exactly as a
// known id is, so its answer does not come back sooner and tell the caller
// which ids exist; every failure is the same UNAUTHENTICATED.
func TestAuthenticateVerifiesEveryKeyID(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		live, revoked, unknownID, wrongSecret := keys(t, db)
		tests := []struct {
			name, bearer string
			ok           bool
			dummy        bool // verified against unknownKeySum
		}{
			{name: "live key", bearer: live, ok: true},
			{name: "known id, wrong secret", bearer: wrongSecret},
			{name: "unknown id", bearer: unknownID, dummy: true},
			{name: "revoked key", bearer: revoked},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				var sums [][]byte
				verify := func(plain string, sum []byte) bool {
					sums = append(sums, sum)
					return secret.Matches(plain, sum)
				}
				p, err := authenticate(context.Background(), db, tc.bearer, verify)
				if tc.ok != (err == nil) {
					t.Fatalf("authenticate = %v, %v; want ok %v", p, err, tc.ok)
				}
				if !tc.ok && errs.CodeOf(err) != errs.Unauthenticated {
					t.Errorf("error %v, want UNAUTHENTICATED", err)
				}
				if len(sums) != 1 {
					t.Fatalf("the secret was verified %d times, want once", len(sums))
				}
				if got := bytes.Equal(sums[0], unknownKeySum); got != tc.dummy || len(sums[0]) != len(unknownKeySum) {
					t.Errorf("verified against the fixed hash: %v, want %v (hash of %d bytes)", got, tc.dummy, len(sums[0]))
				}
			})
		}
	})
}

// BenchmarkAuthenticate compares a refused unknown key id with a refused
// known id (wrong secret) on SQLite. Both run one lookup and one
// verification; what differs is the database finding a row or not.
func BenchmarkAuthenticate(b *testing.B) {
	db := storetest.OpenSQLite(b)
	_, _, unknownID, wrongSecret := keys(b, db)
	for _, bc := range []struct{ name, bearer string }{{"unknown-id", unknownID}, {"wrong-secret", wrongSecret}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := Authenticate(context.Background(), db, bc.bearer); err == nil {
					b.Fatal("authenticated")
				}
			}
		})
	}
}
