package run

import (
	"bytes"
	"crypto/tls"
	"sync"
)

// sessionCache keeps the TLS session tickets of the gateway for one node
// identity, so a session that reconnects resumes its TLS session (no
// certificate signature or verification on either side) instead of a full
// handshake.
//
// SECURITY: a resumed connection is bound to the client certificate of
// the handshake that issued its ticket, not to the one in the tls.Config.
// The cache is therefore per identity: once the node certificate changes
// (a renewal, a rejoin), the tickets of the old one are dropped and the
// next connection presents the new certificate in a full handshake. Our
// own checks of the gateway (VerifyConnection, the pinned serving CA) run
// on resumed connections too.
type sessionCache struct {
	mu    sync.Mutex
	leaf  []byte
	cache tls.ClientSessionCache
}

// For returns the ticket cache for the identity whose leaf is leafDER.
func (s *sessionCache) For(leafDER []byte) tls.ClientSessionCache {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache == nil || !bytes.Equal(s.leaf, leafDER) {
		s.leaf = bytes.Clone(leafDER)
		s.cache = tls.NewLRUClientSessionCache(4)
	}
	return s.cache
}
