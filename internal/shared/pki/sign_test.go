package pki

import (
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"testing"
)

// R4.6: the join response is signed with the join-signing key and verifies
// only under that key, for that body, for that purpose.
func TestSignVerifyResponse(t *testing.T) {
	signing, command := newP256(t), newP256(t)
	body := []byte(`{"nodeId":"node_1","csrSha256":"abc"}`)
	sig, err := SignResponse(signing, body)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyResponse(signing.Public(), body, sig); err != nil {
		t.Fatalf("VerifyResponse: %v", err)
	}
	renewSig, err := SignPurpose(signing, PurposeRenewPoP, body)
	if err != nil {
		t.Fatal(err)
	}
	tampered := append([]byte(nil), sig...)
	tampered[len(tampered)-1] ^= 1
	tests := []struct {
		name    string
		verify  func() error
		wantSig bool // the failure is ErrSignature (not a bad key or purpose)
	}{
		{"another key", func() error { return VerifyResponse(newP256(t).Public(), body, sig) }, true},
		{"the command key", func() error { return VerifyResponse(command.Public(), body, sig) }, true},
		{"another body", func() error { return VerifyResponse(signing.Public(), append(body, ' '), sig) }, true},
		{"tampered signature", func() error { return VerifyResponse(signing.Public(), body, tampered) }, true},
		{"empty signature", func() error { return VerifyResponse(signing.Public(), body, nil) }, true},
		{"renew-pop signature as a response", func() error { return VerifyResponse(signing.Public(), body, renewSig) }, true},
		{"response signature as renew-pop", func() error { return VerifyPurpose(signing.Public(), PurposeRenewPoP, body, sig) }, true},
		{"P-384 key", func() error { return VerifyResponse(mustP384(t).Public(), body, sig) }, false},
		{"bad purpose", func() error { return VerifyPurpose(signing.Public(), "join response", body, sig) }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.verify()
			if err == nil {
				t.Fatal("verified")
			}
			if errors.Is(err, ErrSignature) != tt.wantSig {
				t.Errorf("err = %v, ErrSignature %v", err, tt.wantSig)
			}
		})
	}
}

// R13.1, R12.3: only P-256 keys and clean purposes sign.
func TestSignPurposeRefusals(t *testing.T) {
	_, ed, _ := ed25519.GenerateKey(rand.Reader)
	if _, err := SignPurpose(ed, PurposeCommand, []byte("x")); err == nil {
		t.Error("Ed25519 key signed")
	}
	if _, err := SignPurpose(mustP384(t), PurposeCommand, []byte("x")); err == nil {
		t.Error("P-384 key signed")
	}
	for _, p := range []string{"", "Join", "a\x00b", "a b"} {
		if _, err := SignPurpose(newP256(t), p, []byte("x")); err == nil {
			t.Errorf("purpose %q accepted", p)
		}
	}
}
