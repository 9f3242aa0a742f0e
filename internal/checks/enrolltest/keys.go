package enrolltest

import (
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// rotation is what the fake says of rotated keys (R16.2): the statements
// every join and renewal answer, every Welcome and JoinService.Keys carry,
// and the key answers are signed with.
type rotation struct {
	mu          sync.Mutex
	list        []string
	signer      crypto.Signer
	signingCert []byte
	keysCalls   int
	// stripOuter: answers carry no statements outside their signed body
	// (a server before that field, or a relay that drops it).
	stripOuter bool
}

// outer is what an answer carries outside its signed body (R21.1).
func (r *rotation) outer() []string {
	r.mu.Lock()
	strip := r.stripOuter
	r.mu.Unlock()
	if strip {
		return nil
	}
	return r.statements()
}

// StripOuterStatements makes later join and renewal answers carry their
// statements only inside the signed body, as a relay that drops the
// outer field would.
func (f *JoinService) StripOuterStatements(strip bool) {
	f.rotation.mu.Lock()
	f.rotation.stripOuter = strip
	f.rotation.mu.Unlock()
}

func (r *rotation) statements() []string {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.list)
}

// SetKeyStatements makes every later answer (join, renewal, Welcome, Keys)
// carry statements, whoever signed them: the fake plays a relay that may
// inject anything.
func (f *JoinService) SetKeyStatements(statements []string) {
	f.rotation.mu.Lock()
	f.rotation.list = slices.Clone(statements)
	f.rotation.mu.Unlock()
}

// UseSigner signs later answers with key, sending cert as their signing
// certificate (a rotated join-signing key).
func (f *JoinService) UseSigner(key crypto.Signer, cert *x509.Certificate) {
	f.rotation.mu.Lock()
	f.rotation.signer, f.rotation.signingCert = key, cert.Raw
	f.rotation.mu.Unlock()
}

// KeysCalls returns how many JoinService.Keys calls arrived.
func (f *JoinService) KeysCalls() int {
	f.rotation.mu.Lock()
	defer f.rotation.mu.Unlock()
	return f.rotation.keysCalls
}

// rotated sets a's signer when UseSigner named one.
func (f *JoinService) rotated(a *Answer) {
	f.rotation.mu.Lock()
	defer f.rotation.mu.Unlock()
	if f.rotation.signer != nil {
		a.Signer, a.SigningCert = f.rotation.signer, f.rotation.signingCert
	}
}

// Keys implements JoinService.Keys: the statements, unauthenticated.
func (f *JoinService) Keys(context.Context, *connect.Request[agentv1.KeysRequest]) (*connect.Response[agentv1.KeysResponse], error) {
	f.rotation.mu.Lock()
	f.rotation.keysCalls++
	f.rotation.mu.Unlock()
	return connect.NewResponse(&agentv1.KeysResponse{KeyStatements: f.rotation.statements()}), nil
}

// Renew implements JoinService.Renew as far as bcd's tests need: the chain
// is a node certificate of this PKI whose key signed the proof of
// possession; the answer is a new certificate for the CSR, the same node,
// site and role, signed like a join answer and carrying the statements.
func (f *JoinService) Renew(_ context.Context, req *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
	refuse := func() error {
		return wire.ToWire(discard, "Renew", errs.New(errs.AccessDenied, "Renew refused"))
	}
	m := req.Msg
	if len(m.GetChain()) == 0 {
		return nil, refuse()
	}
	leaf, err := x509.ParseCertificate(m.GetChain()[0])
	if err != nil || leaf.CheckSignatureFrom(f.bundle.NodeCA) != nil {
		return nil, refuse()
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil || id.NodeID != m.GetNodeId() ||
		pki.VerifyRenewPoP(leaf.PublicKey, m.GetCsr(), m.GetNodeId(), m.GetClientTimeUnixMs(), m.GetPopSig()) != nil {
		return nil, refuse()
	}
	a := &Answer{
		Params: ca.NodeCertParams{TrustDomain: id.TrustDomain, SiteID: id.SiteID, NodeID: id.NodeID, Role: id.Role,
			NotBefore: f.now, NotAfter: f.now.Add(24 * time.Hour)},
		CSR: m.GetCsr(), Signer: f.bundle.JoinSigningKey, SigningCert: f.bundle.JoinSigningCert.Raw,
	}
	f.rotated(a)
	nc, err := ca.SignNodeCert(f.bundle.NodeCA, f.bundle.NodeCAKey, a.CSR, a.Params)
	if err != nil {
		f.t.Errorf("fake JoinService: sign node cert: %v", err)
		return nil, refuse()
	}
	body, _ := proto.Marshal(&agentv1.JoinResponseBody{
		NodeId: id.NodeID, CertChain: [][]byte{nc.DER, f.bundle.NodeCA.Raw}, CommandBundle: [][]byte{f.bundle.CommandSigningCert.Raw},
		CsrSha256: pki.CSRHash(a.CSR), TrustDomain: id.TrustDomain, SiteId: id.SiteID, Role: id.Role,
		KeyStatements: f.rotation.statements(),
	})
	sig, err := pki.SignResponse(a.Signer, body)
	if err != nil {
		f.t.Errorf("fake JoinService: %v", err)
		return nil, refuse()
	}
	return connect.NewResponse(&agentv1.RenewResponse{Body: body, Sig: sig, SigningCertificate: a.SigningCert, KeyStatements: f.rotation.outer()}), nil
}

// SetGatewayBundle makes the gateway present a certificate issued by b's
// serving CA from the next handshake on (a rotated serving CA, R16.2).
func (s *Server) SetGatewayBundle(t testing.TB, b *ca.Bundle) {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{GatewayServerName, "127.0.0.1"}, s.Now.Add(-time.Hour), 25*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.cert = &pair
	s.mu.Unlock()
}

// Statement signs a key statement of kind: the key signer says action about
// the key subject (an old key vouching for its successor, or retiring its
// predecessor).
func Statement(t testing.TB, kind, action string, signer crypto.Signer, subject crypto.PublicKey) string {
	t.Helper()
	from, err := x509.MarshalPKIXPublicKey(signer.Public())
	if err != nil {
		t.Fatal(err)
	}
	to, err := x509.MarshalPKIXPublicKey(subject)
	if err != nil {
		t.Fatal(err)
	}
	enc, err := pki.SignKeyStatement(signer, pki.KeyStatement{Kind: kind, Action: action, Signer: from, Subject: to, IssuedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	return enc
}
