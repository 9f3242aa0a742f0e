package session

import (
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/wire"
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
