package tpm_test

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"testing"

	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

func newAttestor(t *testing.T) *tpm.Attestor {
	t.Helper()
	a, err := tpm.New(tpm.Config{ChallengeKey: bytes.Repeat([]byte{7}, 32)})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// softEK is a P-256 endorsement key's TPMT_PUBLIC made in software: the
// shape ParseEK accepts, no TPM needed.
func softEK(t *testing.T) []byte {
	t.Helper()
	k, err := ecdh.P256().GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	raw := k.PublicKey().Bytes() // 0x04 || X || Y
	ek := tpm2.ECCEKTemplate
	ek.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: raw[1:33]}, Y: tpm2.TPM2BECCParameter{Buffer: raw[33:]}})
	return tpm2.Marshal(ek)
}

func evidence(t *testing.T, ekPublic []byte) []byte {
	t.Helper()
	b, err := proto.Marshal(&agentv1.TPMEvidence{EkPublic: ekPublic})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func wantRefusal(t *testing.T, err error, reason string) {
	t.Helper()
	var r *attest.Refusal
	if !errors.As(err, &r) {
		t.Fatalf("want refusal %s, got %v", reason, err)
	}
	// Nothing is proven yet: every refusal goes to the root tenant.
	if r.Reason != reason || r.TenantID != "" {
		t.Fatalf("refusal %s to %q, want %s to the root tenant", r.Reason, r.TenantID, reason)
	}
}

// R9.2: the checks of a tpm join that come before its challenge, in order.
// R15.2: the role is the server's; a tpm join never makes a site or
// ramdisk. These read nothing from the store, so Admit gets no
// transaction.
func TestAdmitRefusals(t *testing.T) {
	a := newAttestor(t)
	ek := evidence(t, softEK(t))
	soft, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(soft, "")
	if err != nil {
		t.Fatal(err)
	}
	// Parseable publics (the EK's own) but no TPM's certify.
	fakeKA, _ := proto.Marshal(&agentv1.TPMKeyAttestation{AkPublic: softEK(t), KeyPublic: softEK(t), CertifyInfo: []byte("x"), Signature: []byte("y")})
	for _, tc := range []struct {
		name   string
		in     attest.Input
		reason string
	}{
		{"token present", attest.Input{Role: "node", Token: "bcjt_x.y", Evidence: ek}, tpm.ReasonTokenPresent},
		{"token beats role", attest.Input{Role: "site", Token: "bcjt_x.y"}, tpm.ReasonTokenPresent},
		{"site role", attest.Input{Role: "site", Evidence: ek}, tpm.ReasonRole},
		{"ramdisk role", attest.Input{Role: "ramdisk", Evidence: ek}, tpm.ReasonRole},
		{"role beats evidence", attest.Input{Role: "ramdisk"}, tpm.ReasonRole},
		{"no evidence", attest.Input{Role: "node"}, tpm.ReasonEvidenceMissing},
		{"evidence not a TPMEvidence", attest.Input{Role: "node", Evidence: []byte{0xff, 0xff}}, tpm.ReasonEvidenceMissing},
		{"EK not a TPMT_PUBLIC", attest.Input{Role: "node", Evidence: evidence(t, []byte("ek"))}, tpmverify.ReasonEKInvalid},
		{"no key attestation", attest.Input{Role: "node", Evidence: ek, CSR: csr}, "key-attestation-missing"},
		{"key attestation garbage", attest.Input{Role: "node", Evidence: ek, CSR: csr, KeyAttestation: []byte{0xff}}, tpmverify.ReasonKeyAttestationInvalid},
		{"CSR garbage", attest.Input{Role: "node", Evidence: ek, CSR: []byte("csr"), KeyAttestation: fakeKA}, "csr-invalid"},
		{"certify by no AK", attest.Input{Role: "node", Evidence: ek, CSR: csr, KeyAttestation: fakeKA}, tpmverify.ReasonAKAttributes},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Both legs check the request before any challenge.
			in := tc.in
			_, err := a.Challenge(context.Background(), &in)
			wantRefusal(t, err, tc.reason)
			_, err = a.Admit(context.Background(), nil, &in)
			wantRefusal(t, err, tc.reason)
		})
	}
}

// R9.2: every API replica derives the same challenge key from the shared
// join-encryption key, and another key gives another challenge key.
func TestChallengeKeyFrom(t *testing.T) {
	k1 := bytes.Repeat([]byte{1}, 32)
	a, b := tpm.ChallengeKeyFrom(k1), tpm.ChallengeKeyFrom(bytes.Clone(k1))
	if !bytes.Equal(a, b) {
		t.Fatal("the same join-encryption key gave two challenge keys")
	}
	if len(a) != 32 || bytes.Equal(a, k1) {
		t.Fatalf("challenge key %x: want 32 bytes, not the input", a)
	}
	if bytes.Equal(a, tpm.ChallengeKeyFrom(bytes.Repeat([]byte{2}, 32))) {
		t.Fatal("two join-encryption keys gave one challenge key")
	}
	if _, err := tpm.New(tpm.Config{ChallengeKey: a}); err != nil {
		t.Fatalf("a derived key must be accepted: %v", err)
	}
}

// R9.2: the attestor needs a challenge key of at least 32 bytes.
func TestNew(t *testing.T) {
	for _, n := range []int{0, 16, 31} {
		if _, err := tpm.New(tpm.Config{ChallengeKey: make([]byte, n)}); err == nil {
			t.Errorf("a %d-byte challenge key was accepted", n)
		}
	}
	if got := newAttestor(t).Name(); got != "tpm" {
		t.Fatalf("Name = %q", got)
	}
}

// pkiSign signs a digest as bcd signs a request (R15.1).
func pkiSign(t *testing.T, key crypto.Signer, digest []byte) []byte {
	t.Helper()
	sig, err := pki.SignJoinRequest(key, digest)
	if err != nil {
		t.Fatal(err)
	}
	return sig
}
