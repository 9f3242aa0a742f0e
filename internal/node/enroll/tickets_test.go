package enroll

import (
	"crypto/tls"
	"testing"
)

// R13.2: a resumed TLS connection carries the certificate of the handshake
// that issued its ticket, so tickets never outlive the identity they were
// issued to: a new node certificate starts with an empty cache.
func TestTicketCachePerIdentityR13_2(t *testing.T) {
	var c TicketCache
	c.For([]byte("leaf a")).Put("gw.example.com:443", &tls.ClientSessionState{})
	if got, ok := c.For([]byte("leaf a")).Get("gw.example.com:443"); !ok || got == nil {
		t.Fatal("the same identity lost its ticket")
	}
	if _, ok := c.For([]byte("leaf b")).Get("gw.example.com:443"); ok {
		t.Fatal("a new identity got the ticket of the old one")
	}
	var none *TicketCache
	if none.For([]byte("leaf a")) != nil {
		t.Fatal("a nil TicketCache made a cache")
	}
}
