package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R15.3: the migration that records which node each TPM is fills the
// table from the certificates of nodes that joined before it (the current
// identity's, of nodes not retired), and NodeByTPMAK reads it.
func TestNodeTPMAKBackfillR15_3(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		n := storetest.Node(t, db, store.NodeAdopted)
		gone := storetest.Node(t, db, store.NodeRetired)
		ak := "urn:bc:tpm-ak:000b" + n.ID
		now := time.Now()
		for i, node := range []store.Node{n, gone} {
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				return tx.InsertNodeCert(ctx, store.NodeCert{Serial: "aa0" + string(rune('0'+i)), NodeID: node.ID, IdentityGeneration: 1, Role: "node",
					SPKISHA256: make([]byte, 32), DER: []byte{1}, AllowedKinds: []byte("[]"), Statements: []byte(`["` + ak + `"]`),
					NotBefore: now, NotAfter: now.Add(time.Hour)})
			}); err != nil {
				t.Fatal(err)
			}
		}
		up, err := store.MigrationUp(db.Dialect(), "00019_node_tpm_aks.sql")
		if err != nil {
			t.Fatal(err)
		}
		backfill := up[strings.Index(up, "INSERT INTO node_tpm_aks"):]
		if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.ExecRaw(ctx, backfill) }); err != nil {
			t.Fatalf("backfill: %v", err)
		}
		var got store.Node
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			got, err = tx.NodeByTPMAK(ctx, n.TenantID, ak)
			if err != nil {
				return err
			}
			if _, err := tx.NodeByTPMAK(ctx, gone.TenantID, ak); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("the retired node's TPM: %v, want not found", err)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if got.ID != n.ID {
			t.Fatalf("the TPM's node is %s, want %s", got.ID, n.ID)
		}
	})
}
