package session

import (
	"context"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// EndNode ends the node's session on this replica, if any, at once: the
// process that retired the node, reclaimed it or revoked its certificate
// calls it after its commit (reason EndRetired, EndReclaimed or
// EndRevoked). A session on another replica ends at that replica's next
// check (Check, well within a second), and a new one is refused.
//
// A retired node's daemon is told so (wire.NodeRetiredMessage; it proved
// its key when the session opened) and stops; any other reason is the
// uniform refusal, after which it reconnects and is refused or, with a
// newer certificate, admitted.
func (s *Service) EndNode(nodeID, reason string) {
	s.mu.Lock()
	c := s.sessions[nodeID]
	s.mu.Unlock()
	if c != nil {
		c.end(reason, endCause(reason))
	}
}

// endCause is what the daemon is told when its session ends for reason.
func endCause(reason string) *errs.E {
	if reason == EndRetired {
		return wire.ErrNodeRetired()
	}
	return errRefused
}

// enter counts a Connect handler in; false once Close began.
func (s *Service) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	s.active++
	return true
}

// leave counts a Connect handler out, after its disconnect was written.
func (s *Service) leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active--
	if s.active == 0 && s.drained != nil {
		close(s.drained)
		s.drained = nil
	}
}

// Close ends every session this replica holds (UNAVAILABLE: reconnect,
// through another replica), refuses new ones, stops the checks of held
// sessions (poll) and waits for them, and waits until every session
// handler returned, its node marked disconnected, or until ctx ends. The server calls it before closing the database, so no session
// writes into a closed store.
func (s *Service) Close(ctx context.Context) error {
	s.mu.Lock()
	if !s.closing {
		close(s.stopPoll) // the checks of held sessions end with them
	}
	s.closing = true
	pollDone := s.pollDone
	conns := make([]*conn, 0, len(s.sessions))
	for _, c := range s.sessions {
		conns = append(conns, c)
	}
	var drained chan struct{}
	if s.active > 0 {
		if s.drained == nil {
			s.drained = make(chan struct{})
		}
		drained = s.drained
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.end(endShutdown, errShutdown)
	}
	if pollDone != nil {
		<-pollDone // promptly: stopPoll is closed
	}
	if drained != nil {
		select {
		case <-drained:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	// Every handler returned, so connect-go closed their request bodies:
	// the readers of streams served without Handler end at once.
	s.readers.Wait()
	return nil
}
