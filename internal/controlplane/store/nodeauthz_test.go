package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// authzBefore is the last migration with node_authz as the projection.
const authzBefore = 20

// R1.3: migration 00021 moves the authorization projection into nodes. A
// node_authz row written before it reads back the same after it (with when
// it was written), a node without one still has none, a projection written
// after it is given back to node_authz by the down migration, and a row a
// previous release's replica writes during a rolling upgrade counts.
func TestNodeAuthzMigrationR1_3(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		joined := storetest.Node(t, db, store.NodeAdopted)
		sibling := func(role string, authz bool) store.Node {
			var n store.Node
			err := db.WithTx(ctx, func(tx *store.Tx) (err error) {
				n, err = tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, time.Now()), TenantID: joined.TenantID, SiteID: joined.SiteID, PoolID: joined.PoolID,
					Role: role, State: store.NodeAdopted, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`), Authz: authz})
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
		without := sibling("site", false)
		projection := func(n store.Node) store.NodeAuthz {
			return store.NodeAuthz{NodeID: n.ID, TenantID: n.TenantID, SiteID: n.SiteID, PoolID: n.PoolID, Role: n.Role}
		}
		read := func(id string) (a store.NodeAuthz, err error) {
			err = db.ReadTx(ctx, func(tx *store.Tx) (err error) { a, err = tx.GetNodeAuthz(ctx, id); return })
			return
		}
		write := func(q string, args ...any) {
			t.Helper()
			if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.ExecRaw(ctx, q, args...) }); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		count := func(q string, args ...any) (n int64) {
			t.Helper()
			if err := db.ReadTx(ctx, func(tx *store.Tx) (err error) { n, err = tx.QueryInt(ctx, q, args...); return }); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
			return n
		}
		const authzRow = "INSERT INTO node_authz (node_id, tenant_id, site_id, pool_id, role, updated_ms) VALUES (?, ?, ?, ?, ?, ?)"

		// Before 00021 a join wrote the node's row and a node_authz row.
		if err := db.MigrateDownTo(ctx, authzBefore); err != nil {
			t.Fatalf("migrate down: %v", err)
		}
		write(authzRow, joined.ID, joined.TenantID, joined.SiteID, joined.PoolID, joined.Role, 1234)
		if err := db.MigrateUp(ctx); err != nil {
			t.Fatalf("migrate up: %v", err)
		}
		if a, err := read(joined.ID); err != nil || a != projection(joined) {
			t.Errorf("carried projection %+v, %v; want %+v", a, err, projection(joined))
		}
		if ms := count("SELECT authz_ms FROM nodes WHERE id = ?", joined.ID); ms != 1234 {
			t.Errorf("authz_ms %d, want node_authz's updated_ms 1234", ms)
		}
		if a, err := read(without.ID); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("node without a projection row reads %+v, %v; want ErrNotFound", a, err)
		}

		// After it, the join writes the projection in the node's row.
		after := sibling("node", true)
		if a, err := read(after.ID); err != nil || a != projection(after) {
			t.Errorf("projection %+v, %v; want %+v", a, err, projection(after))
		}
		// A previous release's replica, mid-upgrade, writes node_authz.
		write(authzRow, without.ID, without.TenantID, without.SiteID, without.PoolID, without.Role, 5678)
		if a, err := read(without.ID); err != nil || a != projection(without) {
			t.Errorf("previous release's projection %+v, %v; want %+v", a, err, projection(without))
		}

		// Rolled back, node_authz holds every projection again.
		if err := db.MigrateDownTo(ctx, authzBefore); err != nil {
			t.Fatalf("migrate down: %v", err)
		}
		for _, n := range []store.Node{joined, after, without} {
			if c := count("SELECT COUNT(*) FROM node_authz WHERE node_id = ? AND tenant_id = ? AND site_id = ? AND pool_id = ? AND role = ?",
				n.ID, n.TenantID, n.SiteID, n.PoolID, n.Role); c != 1 {
				t.Errorf("node_authz rows for %s after the down migration: %d, want 1", n.ID, c)
			}
		}
		if err := db.MigrateUp(ctx); err != nil {
			t.Fatalf("migrate up again: %v", err)
		}
	})
}
