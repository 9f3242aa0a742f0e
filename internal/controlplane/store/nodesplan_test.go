package store_test

import (
	"context"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// TestNodesByHardwareKeyUsesItsIndex: a join's hardware-key lookup is an
// index search in any plan, a prepared statement's generic plan on
// PostgreSQL included (with the trusted flag as a bound parameter that
// plan scanned every node).
func TestNodesByHardwareKeyUsesItsIndex(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		q := store.NodesByHardwareKeySQL(db.Dialect())
		var plan []string
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			var err error
			if db.Dialect() == store.SQLite {
				plan, err = tx.QueryTexts(ctx, "EXPLAIN QUERY PLAN "+q, []byte{1}, 5)
				return err
			}
			// The plan a prepared statement gets once PostgreSQL goes
			// generic; without seqscans so an empty table plans as a large
			// one would.
			for _, s := range []string{"SET LOCAL plan_cache_mode = force_generic_plan", "SET LOCAL enable_seqscan = off",
				"PREPARE by_hw_key AS " + strings.Replace(strings.Replace(q, "?", "$1", 1), "?", "$2", 1)} {
				if err := tx.ExecRaw(ctx, s); err != nil {
					return err
				}
			}
			plan, err = tx.QueryTexts(ctx, `EXPLAIN EXECUTE by_hw_key('\x01', 5)`)
			if err != nil {
				return err
			}
			return tx.ExecRaw(ctx, "DEALLOCATE by_hw_key")
		})
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(plan, "\n")
		if !strings.Contains(text, "nodes_hardware_key_tenant") {
			t.Errorf("NodesByHardwareKey does not use nodes_hardware_key_tenant:\n%s", text)
		}
	})
}
