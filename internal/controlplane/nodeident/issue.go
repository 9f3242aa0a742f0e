package nodeident

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// ErrNotConfigured is the answer to a join or renewal when the server has
// no machine PKI (R4.8: not a refusal).
var ErrNotConfigured = errs.New(errs.InvalidConfig, "JoinService is not configured: the server has no machine PKI (pki.dir)")

// IssueParams is what a path decided about the certificate to issue.
type IssueParams struct {
	// Pub is the CSR's key, whose signature the caller verified
	// (pki.ParseCSR).
	Pub       *ecdsa.PublicKey
	CSRSHA256 []byte
	// Node is the node row as written in this transaction (its id, site
	// and identity generation are the certificate's).
	Node store.Node
	Role string
	// Statements are urn:bc: URI SANs; AllowedKinds restrict command kinds
	// (R7.5). Both travel with the node_certs row.
	Statements   []string
	AllowedKinds []string
	// MaxTTL shortens the lifetime when non-zero: an attestor's limit, or
	// a renewed certificate's own lifetime (a renewal never lengthens).
	MaxTTL time.Duration
}

// Issued is a signed certificate, its row, and the signed answer to send.
type Issued struct {
	Cert     *ca.NodeCert
	Body     *agentv1.JoinResponseBody
	Response *agentv1.JoinResponse
}

// backdateFor is how far before now a certificate of lifetime ttl starts:
// backdate, but at most a tenth of the lifetime, so that a short-lived
// certificate (cert_ttl_seconds down to 60) is still valid when issued and
// bcd's renewal at 60% of the lifetime lies ahead, not behind.
func backdateFor(ttl time.Duration) time.Duration { return min(backdate, ttl/10) }

// TTL is the lifetime policy (R7.1): certTtlSeconds, at most 2 h for
// ramdisk, shortened by maxTTL when non-zero.
func (c *Core) TTL(role string, maxTTL time.Duration) time.Duration {
	ttl := c.cfg.CertTTL
	if role == pki.RoleRamdisk {
		ttl = min(ttl, MaxRamdiskCertTTL)
	}
	if maxTTL > 0 {
		ttl = min(ttl, maxTTL)
	}
	return ttl
}

// Issue is the one way a node certificate is made, always in one order: the
// template comes from policy only (names from the node row, never the CSR),
// it is signed and re-checked (ca.SignNodeCertKey), recorded as a
// node_certs row in tx, and answered as a JoinResponse signed with the
// join-signing key.
func (c *Core) Issue(ctx context.Context, tx *store.Tx, p IssueParams) (*Issued, error) {
	// One snapshot of the keys for the whole answer: a rotation landing
	// meanwhile never mixes two generations in it (R16.1).
	b := c.cfg.Bundle.Now()
	if b == nil {
		return nil, ErrNotConfigured
	}
	if p.Node.ID == "" || p.Node.IdentityGeneration < 1 {
		return nil, errors.New("issue: the node row must be written first")
	}
	ttl := c.TTL(p.Role, p.MaxTTL)
	nb := c.clock.Now().Add(-backdateFor(ttl))
	cert, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, p.Pub, ca.NodeCertParams{
		TrustDomain: b.TrustDomain, SiteID: p.Node.SiteID, NodeID: p.Node.ID, Role: p.Role, Statements: p.Statements,
		NotBefore: nb, NotAfter: nb.Add(ttl), StatementsInExtension: c.cfg.SVIDForm == pki.SVIDFormStrict,
	})
	if err != nil {
		return nil, fmt.Errorf("sign node certificate: %w", err)
	}
	kinds, err := jsonList(p.AllowedKinds)
	if err != nil {
		return nil, fmt.Errorf("marshal allowed kinds: %w", err)
	}
	stmts, err := jsonList(p.Statements)
	if err != nil {
		return nil, fmt.Errorf("marshal statements: %w", err)
	}
	if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: cert.Serial, NodeID: p.Node.ID, IdentityGeneration: p.Node.IdentityGeneration,
		Role: p.Role, SPKISHA256: cert.SPKISHA256, DER: cert.DER, AllowedKinds: kinds, Statements: stmts,
		NotBefore: cert.Cert.NotBefore, NotAfter: cert.Cert.NotAfter}); err != nil {
		return nil, err
	}
	if m := c.cfg.Metrics; m != nil {
		tx.AfterCommit(func() { m.Issued(p.Role) })
	}
	body := &agentv1.JoinResponseBody{
		NodeId: p.Node.ID, CertChain: [][]byte{cert.DER, b.NodeCA.Raw}, CommandBundle: b.CommandBundle(),
		CsrSha256: p.CSRSHA256, TrustDomain: b.TrustDomain, SiteId: p.Node.SiteID, Role: p.Role,
		// R12.3: bcd refuses commands of another generation; it learns its
		// own from this signed body, never from the relay.
		IdentityGeneration: int64(p.Node.IdentityGeneration),
		// R16.2: the daemon learns rotated keys from every answer.
		KeyStatements: b.KeyStatements,
		// R19.3: the daemon dates what it stamps by the server's clock.
		ServerTimeUnixMs: c.clock.Now().UnixMilli(),
	}
	res, err := signAnswer(b, body)
	if err != nil {
		return nil, err
	}
	return &Issued{Cert: cert, Body: body, Response: res}, nil
}

// Reanswer answers again for row, a certificate already issued to node n
// for the CSR whose SHA-256 is csrSHA256 (R21.1): a renewal whose answer
// the daemon never accepted (lost on the way, or refused by a daemon that
// could not check it yet) is sent again with the same CSR and gets the same
// certificate, signed anew with the keys in force, instead of stranding the
// node. Nothing is issued or written.
func (c *Core) Reanswer(n store.Node, row store.NodeCert, csrSHA256 []byte) (*agentv1.JoinResponse, error) {
	b := c.cfg.Bundle.Now()
	if b == nil {
		return nil, ErrNotConfigured
	}
	leaf, err := x509.ParseCertificate(row.DER)
	if err != nil {
		return nil, fmt.Errorf("parse the issued certificate: %w", err)
	}
	var issuer *x509.Certificate
	for _, ca := range b.TrustedNodeCAs() {
		if bytes.Equal(leaf.AuthorityKeyId, ca.SubjectKeyId) {
			issuer = ca
		}
	}
	if issuer == nil {
		return nil, errors.New("the issued certificate's node CA is no longer accepted")
	}
	return signAnswer(b, &agentv1.JoinResponseBody{
		NodeId: n.ID, CertChain: [][]byte{row.DER, issuer.Raw}, CommandBundle: b.CommandBundle(),
		CsrSha256: csrSHA256, TrustDomain: b.TrustDomain, SiteId: n.SiteID, Role: row.Role,
		IdentityGeneration: int64(n.IdentityGeneration), KeyStatements: b.KeyStatements,
		ServerTimeUnixMs: c.clock.Now().UnixMilli(),
	})
}

// Defer answers a join that waits on join request requestID (R10.1): a
// body with no certificate, signed with the join-signing key like any
// answer, for the CSR it will admit.
func (c *Core) Defer(csrSHA256 []byte, siteID, role, requestID string, retryAfter time.Duration) (*agentv1.JoinResponse, error) {
	b := c.cfg.Bundle.Now()
	if b == nil {
		return nil, ErrNotConfigured
	}
	return signAnswer(b, &agentv1.JoinResponseBody{
		CsrSha256: csrSHA256, TrustDomain: b.TrustDomain, SiteId: siteID, Role: role, KeyStatements: b.KeyStatements,
		ServerTimeUnixMs: c.clock.Now().UnixMilli(),
		Deferral:         &agentv1.JoinDeferral{RequestId: requestID, RetryAfterSeconds: int32(retryAfter / time.Second)},
	})
}

// signAnswer serializes body and signs it with the join-signing key.
func signAnswer(b *ca.Bundle, body *agentv1.JoinResponseBody) (*agentv1.JoinResponse, error) {
	raw, err := proto.MarshalOptions{Deterministic: true}.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("marshal join response: %w", err)
	}
	sig, err := pki.SignResponse(b.JoinSigningKey, raw)
	if err != nil {
		return nil, fmt.Errorf("sign join response: %w", err)
	}
	return &agentv1.JoinResponse{Body: raw, Sig: sig, SigningCertificate: b.JoinSigningCert.Raw}, nil
}

// emptyList is the JSON of no strings: most certificates have no
// statements and no kind restriction.
var emptyList = []byte("[]")

// jsonList is the JSON array of s ("[]" for none).
func jsonList(s []string) ([]byte, error) {
	if len(s) == 0 {
		return emptyList, nil
	}
	return json.Marshal(s)
}
