// Package jointest builds what a daemon sends to JoinService (a P-256 key and
// its CSR, hardware claims, a token sealed to the JoinService encryption key)
// and checks what it answers the way bcd does, for tests of JoinService and
// of the services that relay it. It also reads back the refusal events a
// join left, since the daemon never learns the reason.
package jointest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// RefusedMessage is the only message a refused daemon ever sees (R4.7).
const RefusedMessage = "Join refused"

// RaceMessage answers the loser of two racing joins of one machine (R4.8).
const RaceMessage = "This machine joined concurrently; retry"

// Key returns a fresh ECDSA P-256 key.
func Key(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// CSR returns a PKCS#10 request (DER) for key. The subject is deliberately
// something JoinService must ignore.
func CSR(t testing.TB, key any) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: "evil", OrganizationalUnit: []string{"bc-role:site"}},
		DNSNames: []string{"evil.example.com"},
	}, key)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

// Claims returns the claims of machine i: a product UUID, a product serial
// and a MAC, all distinct per i, so the hardware key is trusted and unique.
func Claims(i int) *agentv1.Claims {
	return &agentv1.Claims{
		ProductUuid:   fmt.Sprintf("4c4c4544-0042-3510-8052-%012x", 0xb7c04f000000+i),
		ProductSerial: fmt.Sprintf("SN-%06d", i),
		Macs:          []string{fmt.Sprintf("00:1b:21:%02x:%02x:%02x", byte(i>>16), byte(i>>8), byte(i))},
		Hostname:      fmt.Sprintf("host-%d", i),
	}
}

// Seal seals token to b's JoinService encryption key for req (its CSR and
// whole-request digest), as bcd does.
func Seal(t testing.TB, b *ca.Bundle, token string, req *agentv1.JoinRequest) string {
	t.Helper()
	return SealAt(t, b, token, req, time.Now())
}

// SealAt is Seal with iat at, for a JoinService on a fake clock.
func SealAt(t testing.TB, b *ca.Bundle, token string, req *agentv1.JoinRequest, at time.Time) string {
	t.Helper()
	s, err := pki.Seal(&b.JoinEncryptionKey.PublicKey, token, req.GetCsr(), pki.JoinRequestDigest(req), at)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Machine is one daemon's side of a join: its key, CSR and claims.
type Machine struct {
	Key    *ecdsa.PrivateKey
	CSR    []byte
	Claims *agentv1.Claims
}

// NewMachine makes a machine with a fresh key and the given claims.
func NewMachine(t testing.TB, claims *agentv1.Claims) *Machine {
	t.Helper()
	k := Key(t)
	return &Machine{Key: k, CSR: CSR(t, k), Claims: claims}
}

// Request returns the join request of m presenting token (sealed for m's
// CSR; "" sends no token) for role ("" is node).
func (m *Machine) Request(t testing.TB, b *ca.Bundle, token, role string) *agentv1.JoinRequest {
	t.Helper()
	return m.RequestAt(t, b, token, role, time.Now())
}

// RequestAt is Request with the seal issued at at.
func (m *Machine) RequestAt(t testing.TB, b *ca.Bundle, token, role string, at time.Time) *agentv1.JoinRequest {
	t.Helper()
	req := &agentv1.JoinRequest{Csr: m.CSR, Claims: proto.Clone(m.Claims).(*agentv1.Claims), Role: role, Protocol: 1}
	if token != "" {
		req.SealedToken = SealAt(t, b, token, req, at)
	}
	return req
}

// Joined is a verified join answer.
type Joined struct {
	Body     *agentv1.JoinResponseBody
	Leaf     *x509.Certificate
	Identity pki.NodeIdentity
}

// Verify checks res as bcd does, in bcd's order (R4.6): the signature under
// the join-signing key, csr_sha256, that the leaf certifies the machine's
// key, the SPIFFE SAN, the role (wantRole, when not empty); and that the
// chain verifies against the node CA for client auth.
func (m *Machine) Verify(t testing.TB, b *ca.Bundle, res *agentv1.JoinResponse, wantRole string) *Joined {
	t.Helper()
	return m.VerifyAt(t, b, res, wantRole, time.Time{})
}

// VerifyAt is Verify with the chain checked at now (the zero time: the
// current time), for answers of a JoinService on a fake clock.
func (m *Machine) VerifyAt(t testing.TB, b *ca.Bundle, res *agentv1.JoinResponse, wantRole string, now time.Time) *Joined {
	t.Helper()
	if err := pki.VerifyResponse(b.JoinSigningCert.PublicKey, res.GetBody(), res.GetSig()); err != nil {
		t.Fatalf("join response signature: %v", err)
	}
	if !bytes.Equal(res.GetSigningCertificate(), b.JoinSigningCert.Raw) {
		t.Errorf("signing certificate is not the join-signing certificate")
	}
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
		t.Fatalf("join response body: %v", err)
	}
	sum := sha256.Sum256(m.CSR)
	if !bytes.Equal(body.CsrSha256, sum[:]) {
		t.Fatalf("csr_sha256 %x, want %x", body.CsrSha256, sum[:])
	}
	if len(body.CertChain) == 0 {
		t.Fatal("empty certificate chain")
	}
	leaf, err := x509.ParseCertificate(body.CertChain[0])
	if err != nil {
		t.Fatalf("crypto/x509 cannot parse the leaf: %v", err)
	}
	if pub, ok := leaf.PublicKey.(*ecdsa.PublicKey); !ok || !pub.Equal(&m.Key.PublicKey) {
		t.Fatal("the leaf does not certify the machine's key")
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		t.Fatalf("leaf: %v", err)
	}
	if want := pki.SPIFFEID(b.TrustDomain, body.SiteId, body.NodeId); leaf.URIs[0].String() != want {
		t.Fatalf("SPIFFE SAN %s, want %s", leaf.URIs[0], want)
	}
	if id.Role != body.Role {
		t.Fatalf("leaf role %q, body role %q", id.Role, body.Role)
	}
	if wantRole != "" && body.Role != wantRole {
		t.Fatalf("role %q, want %q", body.Role, wantRole)
	}
	if body.TrustDomain != b.TrustDomain {
		t.Errorf("trust domain %q, want %q", body.TrustDomain, b.TrustDomain)
	}
	roots := x509.NewCertPool()
	roots.AddCert(b.NodeCA)
	inter := x509.NewCertPool()
	for _, der := range body.CertChain[1:] {
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatalf("chain: %v", err)
		}
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("leaf does not verify against the node CA: %v", err)
	}
	if len(body.CommandBundle) == 0 || !bytes.Equal(body.CommandBundle[0], b.CommandSigningCert.Raw) {
		t.Errorf("command bundle is not the command-signing certificate")
	}
	return &Joined{Body: &body, Leaf: leaf, Identity: id}
}

// WantRefused fails unless err is exactly what a refused daemon sees:
// ACCESS_DENIED "Join refused".
func WantRefused(t testing.TB, err error) {
	t.Helper()
	WantError(t, err, errs.AccessDenied, RefusedMessage)
}

// WantError fails unless err is the product error code with message msg.
func WantError(t testing.TB, err error, code errs.Code, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("want %s %q, got success", code, msg)
	}
	e, ok := errs.As(err)
	if !ok {
		t.Fatalf("want %s %q, got %T: %v", code, msg, err, err)
	}
	if e.Code != code || e.Message != msg {
		t.Fatalf("want %s %q, got %s %q", code, msg, e.Code, e.Message)
	}
}

// Refusal is a security.join.refused event's data.
type Refusal struct {
	Attestor    string `json:"attestor"`
	Reason      string `json:"reason"`
	Role        string `json:"role"`
	CSRSHA256   string `json:"csrSha256"`
	HardwareKey string `json:"hardwareKey"`
	Suppressed  int    `json:"suppressed"`
}

// Refusals reads every security.join.refused event of tenant, oldest first.
func Refusals(t testing.TB, db *store.DB, tenant string) []Refusal {
	t.Helper()
	var out []Refusal
	if err := db.WaitEventsVisible(context.Background(), tenant, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var afterTx, afterID int64
		for {
			evs, err := tx.ListEvents(context.Background(), tenant, afterTx, afterID, "security.join.refused", 500)
			if err != nil {
				return err
			}
			for _, e := range evs {
				var r Refusal
				if err := json.Unmarshal(e.Data, &r); err != nil {
					return err
				}
				out = append(out, r)
			}
			if len(evs) < 500 {
				return nil
			}
			afterTx, afterID = evs[len(evs)-1].TxOrder, evs[len(evs)-1].ID
		}
	})
	if err != nil {
		t.Fatalf("read refusals: %v", err)
	}
	return out
}

// Reasons returns the reasons of tenant's refusal events, oldest first.
func Reasons(t testing.TB, db *store.DB, tenant string) []string {
	t.Helper()
	var out []string
	for _, r := range Refusals(t, db, tenant) {
		out = append(out, r.Reason)
	}
	return out
}

// Deferral checks a signed deferral for m (R10.1): signed by the
// join-signing key, for m's CSR, with no certificate, and returns it.
func (m *Machine) Deferral(t testing.TB, b *ca.Bundle, res *agentv1.JoinResponse) *agentv1.JoinDeferral {
	t.Helper()
	if err := pki.VerifyResponse(b.JoinSigningCert.PublicKey, res.GetBody(), res.GetSig()); err != nil {
		t.Fatalf("deferral signature: %v", err)
	}
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
		t.Fatalf("deferral body: %v", err)
	}
	sum := sha256.Sum256(m.CSR)
	switch {
	case !bytes.Equal(body.CsrSha256, sum[:]):
		t.Fatalf("deferral for csr %x, want %x", body.CsrSha256, sum[:])
	case body.GetDeferral() == nil:
		t.Fatalf("answer %v is not a deferral", &body)
	case len(body.CertChain) > 0 || body.NodeId != "":
		t.Fatalf("deferral carries a certificate or node: %v", &body)
	}
	return body.GetDeferral()
}
