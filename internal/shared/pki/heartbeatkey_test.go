package pki

import (
	"bytes"
	"crypto/ecdh"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"testing"
)

func newShare(t testing.TB) *ecdh.PrivateKey {
	t.Helper()
	k, err := NewHeartbeatKeyShare()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// R12.1: the daemon's heartbeat key is bound by its session proof: the
// proof made with a key verifies only with that key, never with another
// or with none (a relay can neither replace nor strip it), and a proof
// made without one still verifies without one (a daemon before the
// field).
func TestSessionProofBindsHeartbeatKey(t *testing.T) {
	key := newP256(t)
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	cert := []byte("certificate DER")
	hk := newShare(t).PublicKey().Bytes()
	sig, err := SignSessionProof(key, nonce, "node_1", cert, hk)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, hk, sig); err != nil {
		t.Fatalf("verify with the key: %v", err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, nil, sig); !errors.Is(err, ErrSignature) {
		t.Errorf("stripped key: %v", err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, newShare(t).PublicKey().Bytes(), sig); !errors.Is(err, ErrSignature) {
		t.Errorf("replaced key: %v", err)
	}
	old, err := SignSessionProof(key, nonce, "node_1", cert, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, nil, old); err != nil {
		t.Errorf("a proof without a key: %v", err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, hk, old); !errors.Is(err, ErrSignature) {
		t.Errorf("a key added to a proof made without one: %v", err)
	}
}

// R12.1: both sides derive the same key; a relay that put its own key in
// Welcome shares a key with the daemon, not with the API; the key is bound
// to the session's nonce, node and certificate.
func TestDeriveHeartbeatKey(t *testing.T) {
	daemon, api, relay := newShare(t), newShare(t), newShare(t)
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	p := HeartbeatKeyParams{Nonce: nonce, NodeID: "node_1", CertDER: []byte("cert"), DaemonKey: daemon.PublicKey().Bytes(), APIKey: api.PublicKey().Bytes()}
	derive := func(own *ecdh.PrivateKey, p HeartbeatKeyParams) []byte {
		t.Helper()
		k, err := DeriveHeartbeatKey(own, p)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	kd, ka := derive(daemon, p), derive(api, p)
	if !bytes.Equal(kd, ka) || len(kd) != HeartbeatKeySize {
		t.Fatalf("the daemon derived %x, the API %x", kd, ka)
	}
	// The relay replaced the API's key in Welcome: the daemon and the
	// relay agree on a key, which is not the API's.
	swapped := p
	swapped.APIKey = relay.PublicKey().Bytes()
	kr, kdr := derive(relay, swapped), derive(daemon, swapped)
	if !bytes.Equal(kr, kdr) || bytes.Equal(kr, ka) {
		t.Errorf("relay %x, daemon through the relay %x, API %x", kr, kdr, ka)
	}
	for name, change := range map[string]func(p *HeartbeatKeyParams){
		"another nonce":       func(p *HeartbeatKeyParams) { p.Nonce = bytes.Repeat([]byte{1}, SessionNonceSize) },
		"another node":        func(p *HeartbeatKeyParams) { p.NodeID = "node_2" },
		"another certificate": func(p *HeartbeatKeyParams) { p.CertDER = []byte("other") },
	} {
		q := p
		change(&q)
		if bytes.Equal(derive(api, q), ka) {
			t.Errorf("%s: the same key", name)
		}
	}
	for name, change := range map[string]func(p *HeartbeatKeyParams){
		"short nonce":       func(p *HeartbeatKeyParams) { p.Nonce = nonce[:16] },
		"short daemon key":  func(p *HeartbeatKeyParams) { p.DaemonKey = p.DaemonKey[:31] },
		"no API key":        func(p *HeartbeatKeyParams) { p.APIKey = nil },
		"low-order point":   func(p *HeartbeatKeyParams) { p.DaemonKey = make([]byte, HeartbeatKeySize) },
		"not the own key's": func(p *HeartbeatKeyParams) { p.APIKey = relay.PublicKey().Bytes() },
	} {
		q := p
		change(&q)
		if k, err := DeriveHeartbeatKey(api, q); err == nil {
			t.Errorf("%s: derived %x", name, k)
		}
	}
}

// R12.1: a heartbeat's MAC is for one key, one session and one place in
// it, and is HMAC-SHA256 over HeartbeatMACMessage.
func TestHeartbeatMAC(t *testing.T) {
	key := bytes.Repeat([]byte{7}, HeartbeatKeySize)
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	m := NewHeartbeatMAC(key, nonce)
	mac := m.Sum(5)
	want := hmac.New(sha256.New, key)
	want.Write(HeartbeatMACMessage(nonce, 5))
	if !bytes.Equal(mac, want.Sum(nil)) {
		t.Fatalf("MAC %x, want HMAC-SHA256 over HeartbeatMACMessage", mac)
	}
	if !m.Verify(5, mac) || !m.Verify(5, mac) {
		t.Error("the MAC does not verify (twice)")
	}
	other := append([]byte(nil), nonce...)
	other[0] ^= 1
	for name, ok := range map[string]bool{
		"another seq":     m.Verify(6, mac),
		"another session": NewHeartbeatMAC(key, other).Verify(5, mac),
		"another key":     NewHeartbeatMAC(bytes.Repeat([]byte{8}, HeartbeatKeySize), nonce).Verify(5, mac),
		"truncated":       m.Verify(5, mac[:16]),
		"none":            m.Verify(5, nil),
	} {
		if ok {
			t.Errorf("%s verified", name)
		}
	}
}

// The API's cost per heartbeat: a MAC against an ECDSA verification.
func BenchmarkHeartbeatCheck(b *testing.B) {
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	b.Run("signature", func(b *testing.B) {
		key := newP256(b)
		sig, err := SignHeartbeat(key, nonce, 1)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if VerifyHeartbeat(key.Public(), nonce, 1, sig) != nil {
				b.Fatal("verify")
			}
		}
	})
	b.Run("mac", func(b *testing.B) {
		m := NewHeartbeatMAC(bytes.Repeat([]byte{7}, HeartbeatKeySize), nonce)
		mac := m.Sum(1)
		b.ReportAllocs()
		for b.Loop() {
			if !m.Verify(1, mac) {
				b.Fatal("verify")
			}
		}
	})
}
