package store_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// pendingNode is a node made ahead of its machine in the pool.
func pendingNode(pl store.Pool, hostname, key string) store.Node {
	return store.Node{ID: ids.New(ids.Node, time.Now()), TenantID: pl.OwnerTenantID, SiteID: pl.SiteID, PoolID: pl.ID, Role: "node",
		State: store.NodePending, Hostname: hostname, IdempotencyKey: key}
}

// a node made ahead is pending at generation 0 with no
// hardware key; one join binds it (generation 1, the machine's facts), a
// second finds it bound; a retired one cannot be bound; idempotency keys
// are unique per tenant.
func TestBindPendingNode(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		_, _, other := fixture(t, db)
		n := mustTx(t, db, func(tx *store.Tx) (store.Node, error) {
			return tx.InsertNode(ctx, pendingNode(pl, "gpu-07", "deploy-7"))
		})
		if n.State != store.NodePending || n.IdentityGeneration != 0 || n.HardwareKey != nil || n.HardwareKeyTrusted || n.Attestor != "" ||
			n.NodeKey != "" || n.Hostname != "gpu-07" || n.IdempotencyKey != "deploy-7" || string(n.Claims) != "{}" {
			t.Fatalf("pending node %+v", n)
		}
		// The key is the tenant's: again in the tenant is a unique
		// violation, in another tenant another node.
		if _, err := withTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.InsertNode(ctx, pendingNode(pl, "", "deploy-7")) }); !store.IsUniqueViolation(err) {
			t.Fatalf("same key twice: %v, want a unique violation", err)
		}
		mustTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.InsertNode(ctx, pendingNode(other, "", "deploy-7")) })
		byKey := mustTx(t, db, func(tx *store.Tx) (store.Node, error) {
			return tx.NodeByIdempotencyKey(ctx, pl.OwnerTenantID, "deploy-7")
		})
		if byKey.ID != n.ID {
			t.Fatalf("by key %s, want %s", byKey.ID, n.ID)
		}
		if _, err := withTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.NodeByIdempotencyKey(ctx, pl.OwnerTenantID, "nope") }); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("unknown key: %v", err)
		}

		bind := func(id, hostname string, key []byte) (store.Node, error) {
			return withTx(t, db, func(tx *store.Tx) (store.Node, error) {
				return tx.BindPendingNode(ctx, store.Node{ID: id, State: store.NodeAdopting, Role: "node", HardwareKey: key, HardwareKeyTrusted: key != nil,
					NodeKey: "unattested", Attestor: "join-token", Hostname: hostname, Claims: []byte(`{"serial":"S"}`), JoinTokenID: "jt_1"})
			})
		}
		// Many joins race for the node: exactly one binds it.
		const racers = 8
		var wg sync.WaitGroup
		errs := make([]error, racers)
		for i := range racers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, errs[i] = bind(n.ID, "", []byte{byte(i + 1)})
			}()
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			switch {
			case err == nil:
				won++
			case !errors.Is(err, store.ErrNotFound):
				t.Fatalf("bind: %v", err)
			}
		}
		if won != 1 {
			t.Fatalf("%d joins bound the node, want 1", won)
		}
		got := mustTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.GetNode(ctx, n.ID) })
		if got.State != store.NodeAdopting || got.IdentityGeneration != 1 || len(got.HardwareKey) != 1 || !got.HardwareKeyTrusted ||
			got.Attestor != "join-token" || got.NodeKey != "unattested" || got.Hostname != "gpu-07" || string(got.Claims) != `{"serial":"S"}` ||
			got.JoinTokenID != "jt_1" || got.IdempotencyKey != "deploy-7" {
			t.Fatalf("bound node %+v", got)
		}

		// The machine's hostname replaces the one given ahead.
		m := mustTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.InsertNode(ctx, pendingNode(pl, "planned", "")) })
		b, err := bind(m.ID, "reported", nil)
		if err != nil || b.Hostname != "reported" || b.HardwareKey != nil || b.HardwareKeyTrusted {
			t.Fatalf("bind %+v %v", b, err)
		}
		// A trusted key another live node of the tenant holds: a unique
		// violation, and the node stays pending.
		k := mustTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.InsertNode(ctx, pendingNode(pl, "", "")) })
		if _, err := bind(k.ID, "", got.HardwareKey); !store.IsUniqueViolation(err) {
			t.Fatalf("bind a held key: %v, want a unique violation", err)
		}
		// A retired pending node is not bound.
		if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.SetNodeState(ctx, k.ID, store.NodeRetired, "not needed") }); err != nil {
			t.Fatal(err)
		}
		if _, err := bind(k.ID, "", nil); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("bind a retired node: %v", err)
		}
		if k := mustTx(t, db, func(tx *store.Tx) (store.Node, error) { return tx.GetNode(ctx, k.ID) }); k.State != store.NodeRetired || !bytes.Equal(k.HardwareKey, nil) {
			t.Fatalf("retired node %+v", k)
		}
	})
}
