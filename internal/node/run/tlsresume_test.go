package run

import (
	"crypto/tls"
	"testing"
)

// R13.2: a resumed TLS connection carries the certificate of the handshake
// that issued its ticket, so tickets never outlive the identity they were
// issued to: a new node certificate starts with an empty cache.
func TestSessionCachePerIdentityR13_2(t *testing.T) {
	var s sessionCache
	a := s.For([]byte("leaf a"))
	a.Put("gw.example.com:443", &tls.ClientSessionState{})
	if got, ok := s.For([]byte("leaf a")).Get("gw.example.com:443"); !ok || got == nil {
		t.Fatal("the same identity lost its ticket")
	}
	if _, ok := s.For([]byte("leaf b")).Get("gw.example.com:443"); ok {
		t.Fatal("a new identity got the ticket of the old one")
	}
}
