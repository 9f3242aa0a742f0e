package enroll

import (
	"bytes"
	"crypto/tls"
	"sync"
)

// TicketCache keeps the gateway's TLS session tickets for one node
// identity, shared by bcd run's session and its renewer, so a session that
// reconnects and a renewal made while the session holds a ticket resume
// the TLS session (no certificate signature or verification on either
// side) instead of a full handshake.
//
// SECURITY: a resumed connection is bound to the client certificate of
// the handshake that issued its ticket, not to the one in the tls.Config.
// The cache is therefore per identity: once the node certificate changes
// (a renewal, a rejoin), the tickets of the old one are dropped and the
// next connection presents the new certificate in a full handshake. bcd's
// own check of the gateway (VerifyConnection against the pinned serving
// CA) runs on resumed connections too.
type TicketCache struct {
	mu    sync.Mutex
	leaf  []byte
	cache tls.ClientSessionCache
}

// For returns the ticket cache of the identity whose leaf is leafDER; a
// nil TicketCache resumes nothing.
func (c *TicketCache) For(leafDER []byte) tls.ClientSessionCache {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cache == nil || !bytes.Equal(c.leaf, leafDER) {
		c.leaf = bytes.Clone(leafDER)
		c.cache = tls.NewLRUClientSessionCache(4)
	}
	return c.cache
}
