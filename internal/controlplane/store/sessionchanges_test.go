package store_test

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// readFeed reads the feed's new rows at now.
func readFeed(t *testing.T, db *store.DB, f *store.SessionFeed, now time.Time) ([]string, bool) {
	t.Helper()
	ctx := context.Background()
	var nodes []string
	var complete bool
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		if !f.Started() {
			if err := f.Start(ctx, tx, now); err != nil {
				return err
			}
		}
		nodes, complete, err = f.Read(ctx, tx, now)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return nodes, complete
}

// R12.1: every write that can end a node's session writes a row of the
// session change feed in its transaction (the triggers of 00025), and the
// writes that end none (a heartbeat, a disconnect, a new certificate, an
// adoption) write none.
func TestSessionFeedWrites(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		type node struct {
			id, serial, sid string
		}
		cases := []struct {
			name  string
			write func(tx *store.Tx, n node) error
			row   bool
		}{
			{"connected by a new session", func(tx *store.Tx, n node) error { _, err := tx.ConnectNode(ctx, n.id, "newer"); return err }, true},
			{"connected by its own session again", func(tx *store.Tx, n node) error { _, err := tx.ConnectNode(ctx, n.id, n.sid); return err }, false},
			{"disconnected", func(tx *store.Tx, n node) error { _, err := tx.DisconnectNode(ctx, n.id, n.sid); return err }, false},
			{"heartbeat", func(tx *store.Tx, n node) error {
				_, err := tx.TouchNodes(ctx, []store.HeldSession{{NodeID: n.id, SessionID: n.sid, Generation: 1}})
				return err
			}, false},
			{"retired", func(tx *store.Tx, n node) error { return tx.SetNodeState(ctx, n.id, store.NodeRetired, "test") }, true},
			{"failed", func(tx *store.Tx, n node) error { return tx.SetNodeState(ctx, n.id, store.NodeFailed, "test") }, false},
			{"reclaimed", func(tx *store.Tx, n node) error {
				got, err := tx.GetNode(ctx, n.id)
				if err != nil {
					return err
				}
				_, err = tx.ReclaimNode(ctx, got, 1)
				return err
			}, true},
			{"certificate revoked", func(tx *store.Tx, n node) error { _, err := tx.RevokeNodeCert(ctx, n.serial, "test"); return err }, true},
			{"certificates of older generations revoked", func(tx *store.Tx, n node) error {
				_, err := tx.RevokeNodeCerts(ctx, n.id, 2, "test")
				return err
			}, true},
			{"certificate superseded", func(tx *store.Tx, n node) error {
				_, err := tx.SupersedeNodeCert(ctx, n.serial, time.Now())
				return err
			}, true},
			{"certificate issued", func(tx *store.Tx, n node) error {
				now := time.Now()
				return tx.InsertNodeCert(ctx, store.NodeCert{Serial: n.serial + "ff", NodeID: n.id, IdentityGeneration: 1, Role: "node", SPKISHA256: []byte{1}, DER: []byte{3},
					NotBefore: now, NotAfter: now.Add(time.Hour)})
			}, false},
		}
		nodes := make([]node, len(cases))
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := range cases {
				sid := fmt.Sprintf("sess_%d", i)
				n, serial := insertNodeWithCert(t, tx, pl, i, sid)
				nodes[i] = node{n.ID, serial, sid}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		var f store.SessionFeed
		now := time.Now()
		readFeed(t, db, &f, now) // the fleet's own connections
		for i, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				if err := db.WithTx(ctx, func(tx *store.Tx) error { return tc.write(tx, nodes[i]) }); err != nil {
					t.Fatal(err)
				}
				got, complete := readFeed(t, db, &f, now)
				if !complete {
					t.Errorf("feed read incomplete")
				}
				want := 0
				if tc.row {
					want = 1
				}
				if len(got) != want || want == 1 && got[0] != nodes[i].id {
					t.Errorf("feed rows %v, want %d of %s", got, want, nodes[i].id)
				}
			})
		}
	})
}

// R12.1 on PostgreSQL: a transaction that took its seq before another but
// commits after a reader passed it is read once it commits (the hole is
// looked for again); a hole that never fills (a rollback) is forgotten
// after FeedGapWait.
func TestSessionFeedCommitOrder(t *testing.T) {
	db, raw := storetest.PostgresWithRaw(t)
	ctx := context.Background()
	_, _, pl := fixture(t, db)
	var slow, fast, rolled store.Node
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		slow, _ = insertNodeWithCert(t, tx, pl, 1, "s1")
		fast, _ = insertNodeWithCert(t, tx, pl, 2, "s2")
		rolled, _ = insertNodeWithCert(t, tx, pl, 3, "s3")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var f store.SessionFeed
	now := time.Now()
	readFeed(t, db, &f, now)
	retire := func(id string) error {
		return db.WithTx(ctx, func(tx *store.Tx) error { return tx.SetNodeState(ctx, id, store.NodeRetired, "test") })
	}
	slowTx, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = slowTx.Rollback() }()
	rollTx, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rollTx.Rollback() }()
	for _, w := range []struct {
		tx *sql.Tx
		id string
	}{{slowTx, slow.ID}, {rollTx, rolled.ID}} {
		if _, err := w.tx.ExecContext(ctx, "UPDATE nodes SET state = 'retired' WHERE id = $1", w.id); err != nil {
			t.Fatal(err)
		}
	}
	if err := retire(fast.ID); err != nil {
		t.Fatal(err)
	}
	if got, _ := readFeed(t, db, &f, now); !slices.Equal(got, []string{fast.ID}) {
		t.Fatalf("before the slow commit: %v, want [%s]", got, fast.ID)
	}
	if f.Gaps() != 2 {
		t.Fatalf("holes %d, want 2 (the open transactions)", f.Gaps())
	}
	if err := slowTx.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := rollTx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if got, _ := readFeed(t, db, &f, now.Add(time.Second)); !slices.Equal(got, []string{slow.ID}) {
		t.Errorf("after the slow commit: %v, want [%s]", got, slow.ID)
	}
	if f.Gaps() != 1 {
		t.Errorf("holes %d, want 1 (the rolled back transaction)", f.Gaps())
	}
	if got, _ := readFeed(t, db, &f, now.Add(store.FeedGapWait)); len(got) != 0 || f.Gaps() != 0 {
		t.Errorf("after %s: rows %v, holes %d; want none", store.FeedGapWait, got, f.Gaps())
	}
}

// Pruning deletes the rows a reader read past FeedRetention ago, never the
// newest; a reader whose position is past the newest row (the table was
// emptied or restored) is behind and starts again; one that did not read
// for half the retention is told it may have missed changes.
func TestSessionFeedPrune(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		var ids []string
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := range 3 {
				n, _ := insertNodeWithCert(t, tx, pl, i, fmt.Sprintf("s%d", i))
				ids = append(ids, n.ID)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		var f store.SessionFeed
		t0 := time.Now()
		readFeed(t, db, &f, t0)
		if upTo := f.Prunable(t0.Add(store.FeedRetention - time.Second)); upTo != 0 {
			t.Errorf("prunable before the retention: %d", upTo)
		}
		upTo := f.Prunable(t0.Add(store.FeedRetention))
		if upTo == 0 {
			t.Fatal("nothing prunable after the retention")
		}
		var pruned, oldest int64
		var behind bool
		if err := db.WithTx(ctx, func(tx *store.Tx) (err error) {
			if pruned, err = tx.PruneSessionChanges(ctx, upTo); err != nil {
				return err
			}
			if oldest, err = tx.OldestSessionChange(ctx); err != nil {
				return err
			}
			behind, err = f.Behind(ctx, tx)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if pruned != 2 || oldest != upTo || behind {
			t.Errorf("pruned %d, oldest %d, behind %v; want 2, %d (the newest kept), false", pruned, oldest, behind, upTo)
		}
		if err := db.WithTx(ctx, func(tx *store.Tx) (err error) {
			if err := tx.ExecRaw(ctx, "DELETE FROM session_changes"); err != nil {
				return err
			}
			behind, err = f.Behind(ctx, tx)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if !behind {
			t.Errorf("not behind an emptied feed")
		}
		if _, complete := readFeed(t, db, &f, t0.Add(store.FeedRetention/2)); complete {
			t.Errorf("a read after %s reported complete", store.FeedRetention/2)
		}
	})
}

// 00025 rolls back and forth: without it a retirement writes no feed row
// (nor fails: no trigger is left behind); with it again, it does.
func TestSessionChangesMigration(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		var a, b store.Node
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			a, _ = insertNodeWithCert(t, tx, pl, 1, "s1")
			b, _ = insertNodeWithCert(t, tx, pl, 2, "s2")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		retire := func(id string) error {
			return db.WithTx(ctx, func(tx *store.Tx) error { return tx.SetNodeState(ctx, id, store.NodeRetired, "test") })
		}
		if err := db.MigrateDownTo(ctx, 24); err != nil {
			t.Fatalf("migrate down: %v", err)
		}
		if err := retire(a.ID); err != nil {
			t.Fatalf("retire without the feed: %v", err)
		}
		if err := db.MigrateUp(ctx); err != nil {
			t.Fatalf("migrate up: %v", err)
		}
		var f store.SessionFeed
		readFeed(t, db, &f, time.Now())
		if err := retire(b.ID); err != nil {
			t.Fatal(err)
		}
		if got, _ := readFeed(t, db, &f, time.Now()); !slices.Equal(got, []string{b.ID}) {
			t.Errorf("feed rows %v, want [%s]", got, b.ID)
		}
	})
}
