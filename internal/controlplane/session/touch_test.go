package session

import (
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R12.1: a heartbeat alone is recorded at once; heartbeats that arrive
// while another handler writes are recorded together by the next writer;
// a session whose node another session took over ends (and its
// last_seen stays).
func TestTouchBatches(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		s, _, conns := benchSessions(t, db, 6, false)
		seen := func(c *conn) time.Time {
			var n store.Node
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				n, err = tx.GetNode(ctx, c.nodeID)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return *n.LastSeen
		}
		// Another session of node 3 took over.
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			_, err := tx.ConnectNode(ctx, conns[3].nodeID, "sess_elsewhere")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		before := make([]time.Time, len(conns))
		latest := time.Time{}
		for i, c := range conns {
			before[i] = seen(c)
			if before[i].After(latest) {
				latest = before[i]
			}
		}
		// So that a write from now on shows as later.
		poll.Until(t, 10*time.Second, "the database clock to move", func() bool {
			var now time.Time
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				now, err = tx.Now(ctx)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return now.After(latest)
		})
		s.touch(ctx, conns[0])
		if !seen(conns[0]).After(before[0]) {
			t.Fatal("a heartbeat alone was not recorded at once")
		}
		// Another handler is writing: these wait for the next writer.
		s.touchMu.Lock()
		s.touching = true
		s.touchMu.Unlock()
		for _, c := range conns[1:5] {
			s.touch(ctx, c)
		}
		for i, c := range conns[1:5] {
			if seen(c).After(before[i+1]) {
				t.Errorf("session %d recorded while another handler writes", i+1)
			}
		}
		s.touchMu.Lock()
		s.touching = false
		s.touchMu.Unlock()
		s.touch(ctx, conns[5]) // writes the queue and its own
		for i, c := range conns {
			if moved := seen(c).After(before[i]); moved != (i != 3) {
				t.Errorf("session %d: last_seen moved %v", i, moved)
			}
			if want := map[bool]string{true: endError}[i == 3]; c.reason() != want {
				t.Errorf("session %d ended %q, want %q", i, c.reason(), want)
			}
		}
		if len(s.touchQueue) != 0 || s.touching {
			t.Errorf("left queued %d, writing %v", len(s.touchQueue), s.touching)
		}
	})
}
