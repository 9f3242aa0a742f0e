package store_test

import (
	"context"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// A ? or a compute_now() in a literal or a comment reaches the database as
// written: before, PostgreSQL got $1 for the literal's ? and no argument for
// the real placeholder, and SQLite got the clock expression inside the
// literal.
func TestRewriteLeavesLiteralsAlone(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		for _, c := range []struct {
			q    string
			args []any
			want string
		}{
			{"SELECT 'it''s ?' || CAST(? AS TEXT) -- why?\n", []any{"!"}, "it's ?!"},
			{`SELECT /* ? */ 'compute_now()' AS "?"`, nil, "compute_now()"},
			{"SELECT CAST(? AS TEXT) || '?' -- compute_now()", []any{"a"}, "a?"},
		} {
			var got []string
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				got, err = tx.QueryTexts(ctx, c.q, c.args...)
				return err
			}); err != nil {
				t.Fatalf("%q: %v", c.q, err)
			}
			if len(got) != 1 || got[0] != c.want {
				t.Errorf("%q = %q, want [%q]", c.q, got, c.want)
			}
		}
	})
}
