package pki

import (
	"crypto/ecdsa"
	"encoding/json"
	"strings"
	"testing"

	"github.com/go-jose/go-jose/v4"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R11.1: join-encryption.jwk round-trips and holds only a P-256 public key.
func TestEncryptionJWK(t *testing.T) {
	key := newP256(t)
	data, err := MarshalEncryptionJWK(&key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := ParseEncryptionJWK(data)
	if err != nil {
		t.Fatalf("ParseEncryptionJWK: %v", err)
	}
	if !pub.Equal(&key.PublicKey) {
		t.Error("round trip changed the key")
	}
	pin, _ := Pin(&key.PublicKey)
	if !PinMatches(pin, pub) {
		t.Error("pin does not match after the round trip")
	}
	if _, err := MarshalEncryptionJWK(mustP384(t).Public().(*ecdsa.PublicKey)); err == nil {
		t.Error("P-384 key marshalled")
	}

	private, _ := json.Marshal(jose.JSONWebKey{Key: key})
	p384, _ := json.Marshal(jose.JSONWebKey{Key: mustP384(t).Public()})
	sig, _ := json.Marshal(jose.JSONWebKey{Key: &key.PublicKey, Use: "sig"})
	otherAlg, _ := json.Marshal(jose.JSONWebKey{Key: &key.PublicKey, Algorithm: "ECDH-ES"})
	withAlg, _ := json.Marshal(jose.JSONWebKey{Key: &key.PublicKey, Use: "enc", Algorithm: "ECDH-ES+A256KW"})
	offCurve := strings.Replace(string(data), `"x":"`, `"x":"A`, 1)
	tests := []struct {
		name string
		data string
		ok   bool
	}{
		{"use enc alg ECDH-ES+A256KW", string(withAlg), true},
		{"private key", string(private), false},
		{"P-384", string(p384), false},
		{"use sig", string(sig), false},
		{"alg ECDH-ES", string(otherAlg), false},
		{"symmetric", `{"kty":"oct","k":"AAAA"}`, false},
		{"off curve", offCurve, false},
		{"not JSON", "nope", false},
		{"huge", `{"kty":"EC","pad":"` + strings.Repeat("a", 5000) + `"}`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseEncryptionJWK([]byte(tt.data))
			if tt.ok != (err == nil) {
				t.Fatalf("err = %v, want ok %v", err, tt.ok)
			}
			if err != nil && errs.CodeOf(err) != errs.InvalidConfig {
				t.Errorf("code = %s", errs.CodeOf(err))
			}
		})
	}
}
