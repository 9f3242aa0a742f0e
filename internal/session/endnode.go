package session

import "github.com/better-compute/better-compute/internal/errs"

// EndNode ends the node's session on this replica, if any (the node was
// retired). A session on another replica ends at its next heartbeat write,
// which refuses a retired node, and a new one is refused at once.
func (s *Service) EndNode(nodeID string) {
	s.mu.Lock()
	c := s.sessions[nodeID]
	s.mu.Unlock()
	if c != nil {
		c.cancel(errs.New(errs.AccessDenied, "Session refused"))
	}
}
