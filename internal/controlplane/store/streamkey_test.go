package store_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R14.3: the key that seals cursors is made once and shared: every replica
// on one database reads the same key. A database that started on this
// version honours no decimal cursor; one that an earlier version wrote
// rows into honours them for a day.
func TestStreamKey(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, dbs []*store.DB) {
		k := dbs[0].StreamKey()
		if len(k.Key) != 32 || bytes.Equal(k.Key, make([]byte, 32)) {
			t.Fatalf("key %x", k.Key)
		}
		if !k.LegacyUntil.IsZero() {
			t.Fatalf("a new database has a legacy window until %v", k.LegacyUntil)
		}
		for _, db := range dbs[1:] {
			if !bytes.Equal(db.StreamKey().Key, k.Key) {
				t.Fatal("two replicas of one database have different keys")
			}
		}
		db := dbs[0]
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			return tx.InsertEvent(ctx, "tn_a", "test.event", "s", []byte("{}"))
		}); err != nil {
			t.Fatal(err)
		}
		if err := db.RemakeStreamKey(ctx); err != nil {
			t.Fatal(err)
		}
		k2 := db.StreamKey()
		if bytes.Equal(k2.Key, k.Key) {
			t.Fatal("a remade key is the old one")
		}
		if d := time.Until(k2.LegacyUntil); d < 23*time.Hour || d > 25*time.Hour {
			t.Fatalf("legacy window ends in %v, want a day", d)
		}
	}
	t.Run("sqlite", func(t *testing.T) { check(t, []*store.DB{storetest.OpenSQLite(t)}) })
	t.Run("postgres", func(t *testing.T) { check(t, storetest.PostgresReplicas(t, 3)) })
}
