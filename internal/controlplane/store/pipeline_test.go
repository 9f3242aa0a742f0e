package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// Held-back writes (PostgreSQL pipelining) keep a transaction's meaning on
// both stores: later statements and reads see them, a failing one fails
// the transaction even when fn ignores the error it surfaced as, and
// nothing of a failed transaction commits (R4.4: refusals leave nothing).
func TestHeldBackWrites(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		n := storetest.Node(t, db, store.NodeAdopting)
		cert := func(serial, nodeID string) store.NodeCert {
			now := time.Now()
			return store.NodeCert{Serial: serial, NodeID: nodeID, IdentityGeneration: 1, Role: "node", SPKISHA256: []byte{1}, DER: []byte{2},
				NotBefore: now, NotAfter: now.Add(time.Hour)}
		}
		t.Run("read after", func(t *testing.T) {
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				if err := tx.InsertNodeCert(ctx, cert("s-read", n.ID)); err != nil {
					return err
				}
				if err := tx.EnqueueWork(ctx, "adopt", n.ID); err != nil {
					return err
				}
				if _, err := tx.GetNodeCert(ctx, "s-read"); err != nil {
					t.Errorf("held-back certificate not read back: %v", err)
				}
				w, err := tx.NodeWork(ctx, n.ID)
				if err != nil || len(w) != 1 || w[0].Kind != "adopt" {
					t.Errorf("held-back work item = %+v, %v", w, err)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
		tests := []struct {
			name string
			// after runs after the failing held-back insert; its error is
			// ignored, as a careless fn might.
			after func(tx *store.Tx) error
		}{
			{"failure at commit", func(*store.Tx) error { return nil }},
			{"failure on the next write", func(tx *store.Tx) error { return tx.EnqueueWork(ctx, "adopt", n.ID) }},
			{"failure on the next read", func(tx *store.Tx) error { _, err := tx.GetNode(ctx, n.ID); return err }},
			{"failure on the next immediate write", func(tx *store.Tx) error {
				return tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: []byte("held-back-" + n.ID), NodeID: n.ID, Response: []byte{1}, TTL: time.Hour})
			}},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				err := db.WithTx(ctx, func(tx *store.Tx) error {
					if err := tx.InsertEvent(ctx, n.TenantID, "test.held-back", n.ID, []byte(`{}`)); err != nil {
						return err
					}
					// No such node: a foreign-key violation.
					if err := tx.InsertNodeCert(ctx, cert("s-"+tc.name, "nd_missing")); err != nil {
						return err
					}
					_ = tc.after(tx)
					return nil
				})
				if err == nil {
					t.Fatal("a failed held-back insert committed")
				}
				if errors.Is(err, store.ErrCommitUnknown) {
					t.Fatalf("err = %v, want a rollback", err)
				}
				_ = db.ReadTx(ctx, func(tx *store.Tx) error {
					if _, err := tx.GetNodeCert(ctx, "s-"+tc.name); !errors.Is(err, store.ErrNotFound) {
						t.Errorf("certificate of a failed transaction: %v", err)
					}
					if _, err := tx.GetJoinAnswer(ctx, []byte("held-back-"+n.ID)); !errors.Is(err, store.ErrNotFound) {
						t.Errorf("answer of a failed transaction: %v", err)
					}
					return nil
				})
			})
		}
		// A duplicate answer is the transaction's unique violation. On
		// SQLite InsertJoinAnswer reports it itself; on PostgreSQL it is
		// held back too, and the violation comes with the batch it goes
		// in (here the COMMIT's flush).
		dup := store.JoinAnswer{RequestDigest: []byte("dup-" + n.ID), NodeID: n.ID, Response: []byte{1}, TTL: time.Hour}
		if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.InsertJoinAnswer(ctx, dup) }); err != nil {
			t.Fatal(err)
		}
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertEvent(ctx, n.TenantID, "test.held-back", n.ID, []byte(`{}`)); err != nil {
				return err
			}
			err := tx.InsertJoinAnswer(ctx, dup)
			if db.Dialect() == store.SQLite && !store.IsUniqueViolation(err) {
				t.Errorf("duplicate answer: err = %v, want a unique violation", err)
			}
			return err
		})
		if !store.IsUniqueViolation(err) {
			t.Errorf("transaction err = %v", err)
		}
	})
}
