package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// insertNodeWithCert inserts an adopted node of generation 1 with one
// certificate, connected by session sid.
func insertNodeWithCert(t *testing.T, tx *store.Tx, pl store.Pool, i int, sid string) (store.Node, string) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	n, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, now), TenantID: pl.OwnerTenantID, SiteID: pl.SiteID, PoolID: pl.ID, Role: "node",
		State: store.NodeAdopted, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	serial := fmt.Sprintf("%x", now.UnixNano()+int64(i))
	if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: serial, NodeID: n.ID, IdentityGeneration: 1, Role: "node", SPKISHA256: []byte{1}, DER: []byte{2},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	if sid != "" {
		if _, err := tx.ConnectNode(ctx, n.ID, sid); err != nil {
			t.Fatal(err)
		}
	}
	return n, serial
}

// R12.1: one query tells the session service which held sessions are no
// longer live as they were opened (another session took over, the node
// was retired, reclaimed or is gone, the certificate revoked, not the
// node's, or superseded), and nothing about the others; sets larger than
// a chunk are read whole.
func TestChangedSessions(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		const many = 140 // more than one chunk of 128
		var held []store.HeldSession
		supersededAt := time.UnixMilli(time.Now().UnixMilli())
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := range many {
				sid := fmt.Sprintf("sess_%d", i)
				n, serial := insertNodeWithCert(t, tx, pl, i, sid)
				held = append(held, store.HeldSession{NodeID: n.ID, SessionID: sid, Serial: serial, Generation: 1})
			}
			// 0: retired; 1: reclaimed (generation 2); 2: certificate
			// revoked; 3: another session took over; 5: renewed
			// (superseded); 130: in the second chunk, retired.
			for _, i := range []int{0, 130} {
				if err := tx.SetNodeState(ctx, held[i].NodeID, store.NodeRetired, "test"); err != nil {
					return err
				}
			}
			n1, err := tx.GetNode(ctx, held[1].NodeID)
			if err != nil {
				return err
			}
			if _, err := tx.ReclaimNode(ctx, n1, 1); err != nil {
				return err
			}
			if _, err := tx.RevokeNodeCerts(ctx, held[2].NodeID, 2, "test"); err != nil {
				return err
			}
			if _, err := tx.SupersedeNodeCert(ctx, held[5].Serial, supersededAt); err != nil {
				return err
			}
			_, err = tx.ConnectNode(ctx, held[3].NodeID, "sess_elsewhere")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		// A node that does not exist, a session held with another node's
		// serial, and one held at another generation.
		held = append(held, store.HeldSession{NodeID: "node_gone", SessionID: "s", Serial: "ab", Generation: 1})
		held[7].Serial = held[8].Serial
		held[9].Generation = 2
		var got []store.SessionState
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			got, err = tx.ChangedSessions(ctx, held)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		byIndex := map[int]store.SessionState{}
		var order []int
		for _, s := range got {
			if s.NodeID != held[s.Held].NodeID {
				t.Fatalf("state %d is of %s, want %s", s.Held, s.NodeID, held[s.Held].NodeID)
			}
			byIndex[s.Held] = s
			order = append(order, s.Held)
		}
		want := []int{0, 1, 2, 3, 5, 7, 9, 130, many}
		if fmt.Sprint(order) != fmt.Sprint(want) {
			t.Fatalf("changed sessions %v, want %v", order, want)
		}
		check := func(i int, what string, ok bool) {
			t.Helper()
			if !ok {
				t.Errorf("session %d (%s): %+v", i, what, byIndex[i])
			}
		}
		check(0, "retired", byIndex[0].State == store.NodeRetired)
		check(1, "reclaimed", byIndex[1].IdentityGeneration == 2 && byIndex[1].CertGeneration == 1 && byIndex[1].CertFound)
		check(2, "revoked", byIndex[2].CertRevoked && byIndex[2].CertFound)
		check(3, "taken over", byIndex[3].SessionID == "sess_elsewhere")
		check(5, "superseded", byIndex[5].CertSupersededAt != nil && byIndex[5].CertSupersededAt.Equal(supersededAt) && byIndex[5].CertFound)
		check(7, "another node's serial", byIndex[7].NodeFound && !byIndex[7].CertFound)
		check(9, "another generation", byIndex[9].NodeFound && byIndex[9].IdentityGeneration == 1 && byIndex[9].CertGeneration == 1)
		check(130, "retired, second chunk", byIndex[130].State == store.NodeRetired)
		check(many, "gone", !byIndex[many].NodeFound)
	})
}

// A session that ended without an answer puts its sent commands back in
// the queue; queued, finished and other nodes' commands are untouched.
func TestRequeueCommands(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		now := time.Now()
		var node, other string
		var sent []string
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			n, _ := insertNodeWithCert(t, tx, pl, 1, "s1")
			o, _ := insertNodeWithCert(t, tx, pl, 2, "s2")
			node, other = n.ID, o.ID
			for i := range 20 {
				id := fmt.Sprintf("cmd_%02d", i)
				nodeID := node
				if i == 19 {
					nodeID = other
				}
				if err := tx.InsertCommand(ctx, store.Command{ID: id, NodeID: nodeID, IdentityGeneration: 1, Kind: "node.facts", CreatedAt: now, ExpiresAt: now.Add(time.Hour)}); err != nil {
					return err
				}
				if i == 0 {
					continue // stays queued
				}
				if _, err := tx.MarkCommandSent(ctx, id); err != nil {
					return err
				}
				if i == 1 {
					if _, err := tx.FinishCommand(ctx, id, store.CommandDone, []byte(`{}`), ""); err != nil {
						return err
					}
				}
				sent = append(sent, id)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			var err error
			n, err = tx.RequeueCommands(ctx, node, append(sent, "cmd_00", "cmd_unknown"))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if n != 17 { // cmd_02..cmd_18
			t.Errorf("requeued %d, want 17", n)
		}
		_ = db.ReadTx(ctx, func(tx *store.Tx) error {
			for i := range 20 {
				c, err := tx.GetCommand(ctx, fmt.Sprintf("cmd_%02d", i))
				if err != nil {
					t.Fatal(err)
				}
				want := store.CommandQueued
				switch i {
				case 1:
					want = store.CommandDone
				case 19:
					want = store.CommandSent
				}
				if c.State != want || (want == store.CommandQueued && c.SentAt != nil) {
					t.Errorf("%s: %s sent %v, want %s", c.ID, c.State, c.SentAt, want)
				}
			}
			return nil
		})
	})
}

// R12.1: one statement records the heartbeats of many sessions and names
// those that no longer speak for their node (another session took over,
// the node was retired or reclaimed, or is gone); their last_seen stays.
func TestTouchNodes(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		const many = 20 // more than one list of 16
		var held []store.HeldSession
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := range many {
				sid := fmt.Sprintf("sess_%d", i)
				n, serial := insertNodeWithCert(t, tx, pl, i, sid)
				held = append(held, store.HeldSession{NodeID: n.ID, SessionID: sid, Serial: serial, Generation: 1})
			}
			// 0: retired; 1: reclaimed; 2: another session took over.
			if err := tx.SetNodeState(ctx, held[0].NodeID, store.NodeRetired, "test"); err != nil {
				return err
			}
			n1, err := tx.GetNode(ctx, held[1].NodeID)
			if err != nil {
				return err
			}
			if _, err := tx.ReclaimNode(ctx, n1, 1); err != nil {
				return err
			}
			_, err = tx.ConnectNode(ctx, held[2].NodeID, "sess_elsewhere")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, store.HeldSession{NodeID: "node_gone", SessionID: "s", Generation: 1})
		seen := func(id string) time.Time {
			var n store.Node
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				n, err = tx.GetNode(ctx, id)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return *n.LastSeen
		}
		before := map[string]time.Time{}
		for _, h := range held[:many] {
			before[h.NodeID] = seen(h.NodeID)
		}
		waitDBClockPast(t, db, before[held[many-1].NodeID])
		for _, batch := range [][]store.HeldSession{held[3:4], held} { // one, and more than a list
			var stale []string
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				var err error
				stale, err = tx.TouchNodes(ctx, batch)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			want := []string{}
			if len(batch) > 1 {
				want = []string{held[0].NodeID, held[1].NodeID, held[2].NodeID, "node_gone"}
			}
			if fmt.Sprint(stale) != fmt.Sprint(want) {
				t.Errorf("stale %v, want %v", stale, want)
			}
		}
		for i, h := range held[:many] {
			if moved := seen(h.NodeID).After(before[h.NodeID]); moved != (i >= 3) {
				t.Errorf("session %d: last_seen moved %v", i, moved)
			}
		}
	})
}

// waitDBClockPast waits until the database's clock is past at, so a
// write after it returns shows as later than at.
func waitDBClockPast(t *testing.T, db *store.DB, at time.Time) {
	t.Helper()
	poll.Until(t, 10*time.Second, "the database clock to move", func() bool {
		var now time.Time
		if err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
			var err error
			now, err = tx.Now(context.Background())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return now.After(at)
	})
}
