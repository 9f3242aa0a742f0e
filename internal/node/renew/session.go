package renew

import (
	"sync"

	"connectrpc.com/connect"
)

// SessionConn is bcd run's session connection to the gateway, offered to
// the renewer (Config.Session): a renewal is then one more call on the
// session's HTTP/2 connection instead of a second TLS connection.
//
// SECURITY: the session offers its client only while it is welcomed on a
// certificate, under that certificate's serial, and the renewer takes it
// only for the certificate it renews. The connection was opened with that
// certificate as its TLS client certificate, pinned to the serving CA like
// the renewer's own, so the renewal is authenticated by the current
// certificate at the TLS layer exactly as over a connection of its own
// (R13.2: the caller's mTLS identity is the node); should the connection
// be gone, the client dials again with the same configuration.
//
// The zero value holds nothing; a nil *SessionConn holds nothing either.
type SessionConn struct {
	mu     sync.Mutex
	serial string
	client connect.HTTPClient
	// offers counts Offer calls, so a withdrawal never takes back a
	// later offer.
	offers uint64
}

// Offer makes client, whose connection presents the certificate serial,
// the one renewals of that certificate use, until the returned func
// withdraws it.
func (s *SessionConn) Offer(serial string, client connect.HTTPClient) (withdraw func()) {
	if s == nil {
		return func() {}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.offers++
	n := s.offers
	s.serial, s.client = serial, client
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.offers == n {
			s.serial, s.client = "", nil
		}
	}
}

// For returns the client offered for the certificate serial, or nil.
func (s *SessionConn) For(serial string) connect.HTTPClient {
	if s == nil || serial == "" {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.serial != serial {
		return nil
	}
	return s.client
}
