package session

import (
	"context"

	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// maxTouchRounds bounds how many batches one handler writes for the others
// before it goes back to its own session: under a steady stream of
// heartbeats the queue never empties, and the next handler with a
// heartbeat to record takes over.
const maxTouchRounds = 4

// touch records c's heartbeat (nodes.last_seen, at most every TouchEvery
// per session). A handler that finds no write in progress writes its own
// and then every heartbeat that queued up meanwhile, in one transaction
// per batch (store.TouchNodes: one statement per 128 sessions), so a
// replica holding many sessions writes a few transactions a second
// instead of one per heartbeat; alone, a heartbeat is written at once, as
// before. A session whose node the write finds taken over (another
// session, a reclaim, a retirement) ends, as checkHeld would end it
// within Check.
func (s *Service) touch(ctx context.Context, c *conn) {
	s.touchMu.Lock()
	s.touchQueue = append(s.touchQueue, c)
	if s.touching {
		s.touchMu.Unlock()
		return
	}
	s.touching = true
	ctx = context.WithoutCancel(ctx) // the batch is others' too
	for range maxTouchRounds {
		batch := s.touchQueue
		s.touchQueue = nil
		if len(batch) == 0 {
			break
		}
		s.touchMu.Unlock()
		s.writeTouches(ctx, batch)
		s.touchMu.Lock()
	}
	s.touching = false
	s.touchMu.Unlock()
}

// writeTouches writes one batch of heartbeats and ends the sessions that
// no longer speak for their node.
func (s *Service) writeTouches(ctx context.Context, batch []*conn) {
	held := make([]store.HeldSession, len(batch))
	for i, c := range batch {
		held[i] = store.HeldSession{NodeID: c.nodeID, SessionID: c.id, Generation: c.generation}
	}
	var stale []string
	err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		stale, err = tx.TouchNodes(ctx, held)
		return err
	})
	if err != nil {
		s.log.Warn("record heartbeats", "sessions", len(batch), "err", err)
		return
	}
	if len(stale) == 0 {
		return
	}
	over := make(map[string]bool, len(stale))
	for _, id := range stale {
		over[id] = true
	}
	for _, c := range batch {
		if over[c.nodeID] {
			// Another session took over, the node was reclaimed or retired.
			c.end(endError, errRefused)
		}
	}
}
