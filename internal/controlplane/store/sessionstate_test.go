package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

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

// R12.1: one query tells the session service, for every held session,
// whether another session took over, the node was retired or reclaimed,
// or the certificate revoked; sets larger than a chunk are read whole.
func TestSessionStates(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		const many = 140 // more than one chunk of 128
		var held []store.HeldSession
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := range many {
				sid := fmt.Sprintf("sess_%d", i)
				n, serial := insertNodeWithCert(t, tx, pl, i, sid)
				held = append(held, store.HeldSession{NodeID: n.ID, SessionID: sid, Serial: serial})
			}
			// 0: retired; 1: reclaimed (generation 2); 2: certificate
			// revoked; 3: another session took over.
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
			if _, err := tx.RevokeNodeCerts(ctx, held[2].NodeID, 2, "test"); err != nil {
				return err
			}
			_, err = tx.ConnectNode(ctx, held[3].NodeID, "sess_elsewhere")
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		// A node that does not exist, and a session held with another
		// node's serial.
		held = append(held, store.HeldSession{NodeID: "node_gone", SessionID: "s", Serial: "ab"})
		held[7].Serial = held[8].Serial
		var got []store.SessionState
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			got, err = tx.SessionStates(ctx, held)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if len(got) != len(held) {
			t.Fatalf("%d states for %d sessions", len(got), len(held))
		}
		for i, s := range got {
			if s.NodeID != held[i].NodeID {
				t.Fatalf("state %d is of %s, want %s", i, s.NodeID, held[i].NodeID)
			}
		}
		check := func(i int, what string, ok bool) {
			t.Helper()
			if !ok {
				t.Errorf("session %d (%s): %+v", i, what, got[i])
			}
		}
		check(0, "retired", got[0].State == store.NodeRetired)
		check(1, "reclaimed", got[1].IdentityGeneration == 2 && got[1].CertGeneration == 1 && got[1].CertFound)
		check(2, "revoked", got[2].CertRevoked && got[2].CertFound)
		check(3, "taken over", got[3].SessionID == "sess_elsewhere")
		check(7, "another node's serial", got[7].NodeFound && !got[7].CertFound)
		for i := 4; i < many; i++ {
			if i == 7 {
				continue
			}
			s := got[i]
			check(i, "live", s.NodeFound && s.CertFound && !s.CertRevoked && s.SessionID == held[i].SessionID &&
				s.State == store.NodeAdopted && s.IdentityGeneration == 1 && s.CertGeneration == 1)
		}
		check(many, "gone", !got[many].NodeFound)
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
