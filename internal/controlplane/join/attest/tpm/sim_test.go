package tpm_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R15.1: with a real certify (swtpm), the node key's signature over the
// whole request digest is checked before any challenge is issued: an
// unsigned request, one signed by another key and one signed for another
// request are refused; a signed one gets its challenge, expiring
// ChallengeTTL after the attestor's clock.
func TestRequestSignature(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	key, err := tp.NewNodeKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(key, "")
	if err != nil {
		t.Fatal(err)
	}
	att, err := tp.Certify(key, pki.CSRHash(csr))
	if err != nil {
		t.Fatal(err)
	}
	ka, _ := att.Marshal()
	ek, err := tp.EK(tpmdevice.EKP256)
	if err != nil {
		t.Fatal(err)
	}
	ev := evidence(t, ek.PublicBytes())
	jr := &agentv1.JoinRequest{Csr: csr, Attestor: tpm.Name, Protocol: 1, Evidence: ev, KeyAttestation: ka}
	digest := pki.JoinRequestDigest(jr)
	other := proto.Clone(jr).(*agentv1.JoinRequest)
	other.Claims = &agentv1.Claims{Hostname: "relayed"}
	soft, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)

	clk := clock.NewFake(time.UnixMilli(1_700_000_000_000))
	a, err := tpm.New(tpm.Config{ChallengeKey: bytes.Repeat([]byte{7}, 32), Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	input := func(sig []byte) *attest.Input {
		return &attest.Input{Role: "node", CSR: csr, CSRSHA256: pki.CSRHash(csr), Evidence: ev, KeyAttestation: ka,
			RequestDigest: digest, RequestSig: sig}
	}
	for name, sig := range map[string][]byte{
		"unsigned":        nil,
		"another key":     pkiSign(t, soft, digest),
		"another request": pkiSign(t, key, pki.JoinRequestDigest(other)),
		"not a signature": []byte("sig"),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := a.Challenge(context.Background(), input(sig))
			wantRefusal(t, err, tpm.ReasonRequestSig)
			_, err = a.Admit(context.Background(), nil, input(sig))
			wantRefusal(t, err, tpm.ReasonRequestSig)
		})
	}

	var got agentv1.TPMChallenge
	ch, err := a.Challenge(context.Background(), input(pkiSign(t, key, digest)))
	if err != nil {
		t.Fatalf("a signed request: %v, want its challenge", err)
	}
	if err := proto.Unmarshal(ch, &got); err != nil {
		t.Fatal(err)
	}
	if want := clk.Now().Add(tpm.ChallengeTTL).UnixMilli(); got.GetExpiresUnixMs() != want || len(got.GetCredentialBlob()) == 0 {
		t.Fatalf("challenge expires %d (blob %d bytes), want %d", got.GetExpiresUnixMs(), len(got.GetCredentialBlob()), want)
	}
}
