package nodeident

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Refusal is a refused join, renewal or session. Reason is recorded
// server-side only; the caller sees the uniform refusal of its path.
type Refusal struct {
	Reason string
	// TenantID routes the refusal event: the node's (or token's) tenant
	// once the caller proved something only that tenant's machine holds,
	// else "" (the root tenant).
	TenantID string
	// NodeID and Serial are set once the presented certificate matched a
	// stored row: before that they would be the caller's own text.
	NodeID, Serial string
}

func (r *Refusal) Error() string { return "refused: " + r.Reason }

// Refuse returns a Refusal.
func Refuse(reason, tenantID string) *Refusal { return &Refusal{Reason: reason, TenantID: tenantID} }

// Use says what a presented certificate is for. The rules differ only where
// the use needs them.
type Use int

const (
	// ForRenew: the node's newest certificate, valid now (R13.2).
	ForRenew Use = iota + 1
	// ForSession: valid now, and the newest or superseded less than
	// SessionOverlap ago (R12.1).
	ForSession
	// ForRejoin (x509pop, R10.5): the node's newest certificate, expired
	// less than MaxExpiredFor ago; a valid one renews instead.
	ForRejoin
)

// Presented is a certificate a caller presented, and how it proves
// possession of the certificate's key.
type Presented struct {
	// DER is the leaf as presented.
	DER []byte
	// Prove checks the caller's proof of possession under the leaf's key.
	// It runs once the leaf matched a stored row. nil: see Proven.
	Prove func(pub crypto.PublicKey) error
	// ProofReason is the refusal reason when Prove fails (default
	// "pop-invalid").
	ProofReason string
	// Proven says the caller verified possession of the leaf's key before
	// calling Check (e.g. a session's signed nonce). With neither Prove nor
	// Proven, refusals go to the root tenant only.
	Proven bool
}

// Checked is a certificate that passed Check: its stored row and node.
type Checked struct {
	Leaf *x509.Certificate
	ID   pki.NodeIdentity
	Row  store.NodeCert
	Node store.Node
}

// Check decides whether a presented certificate identifies a node for use.
// It is the one check of a presented node certificate: the leaf must be
// byte for byte a node_certs row (a re-signed or altered copy is not), the
// caller must prove possession of its key, the node must not be retired,
// and the row must be of the node's current identity generation,
// unrevoked, the newest (not superseded; sessions allow SessionOverlap),
// and inside its validity (ForRejoin: expired, but less than MaxExpiredFor
// ago). A refusal is a *Refusal; any other error is internal.
func (c *Core) Check(ctx context.Context, tx *store.Tx, p Presented, use Use) (*Checked, error) {
	if len(p.DER) == 0 {
		return nil, Refuse("cert-missing", "")
	}
	leaf, err := x509.ParseCertificate(p.DER)
	if err != nil {
		return nil, Refuse("cert-invalid", "")
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		return nil, Refuse("cert-invalid", "")
	}
	// The row and its node in one read (node_certs.node_id references
	// nodes, so every row has its node).
	row, n, err := tx.GetNodeCertAndNode(ctx, pki.SerialHex(leaf))
	if errors.Is(err, store.ErrNotFound) || err == nil && !bytes.Equal(row.DER, p.DER) {
		// Not a certificate JoinService issued, or a re-signed or altered
		// copy of one.
		return nil, Refuse("cert-unknown", "")
	} else if err != nil {
		return nil, fmt.Errorf("read the certificate and its node: %w", err)
	}
	proven := p.Proven
	if p.Prove != nil {
		if err := p.Prove(leaf.PublicKey); err != nil {
			reason := p.ProofReason
			if reason == "" {
				reason = "pop-invalid"
			}
			return nil, &Refusal{Reason: reason, NodeID: n.ID, Serial: row.Serial}
		}
		proven = true
	}
	ref := func(reason string) (*Checked, error) {
		r := &Refusal{Reason: reason, NodeID: n.ID, Serial: row.Serial}
		if proven {
			// The caller holds the key of one of this node's
			// certificates: the node's owner should see why it failed.
			r.TenantID = n.TenantID
		}
		return nil, r
	}
	now := c.clock.Now()
	switch {
	case id.NodeID != n.ID:
		return ref("cert-node")
	case n.State == store.NodeRetired:
		return ref("node-retired")
	case row.IdentityGeneration != n.IdentityGeneration:
		return ref("cert-generation")
	case row.RevokedAt != nil:
		return ref("cert-revoked")
	case row.SupersededAt != nil && (use != ForSession || !now.Before(row.SupersededAt.Add(SessionOverlap))):
		return ref("cert-superseded")
	case now.Before(row.NotBefore):
		return ref("cert-not-yet-valid")
	case !c.issuerAccepted(leaf) && (use != ForRenew && use != ForRejoin || !c.issuedByRetired(leaf)):
		// R16.1, R21.2: a certificate of a retired node CA opens no
		// session, though node_certs still knows it. R21.1: it may still
		// renew or re-join (the row and the proof of its key are what the
		// API trusts), so a node offline through the rotation comes back
		// onto the current CA by itself.
		return ref("cert-ca-retired")
	}
	if use == ForRejoin {
		switch {
		case now.Before(row.NotAfter):
			return ref("cert-not-expired")
		case now.Sub(row.NotAfter) >= MaxExpiredFor:
			return ref("cert-expired-too-long")
		}
	} else if !now.Before(row.NotAfter) {
		return ref("cert-expired")
	}
	return &Checked{Leaf: leaf, ID: id, Row: row, Node: n}, nil
}

// IssuerAccepted reports whether a certificate whose authority key id and
// issuer are akid and rawIssuer was issued by a node CA still accepted:
// a session held on a certificate of a retired node CA ends (R21.2).
func (c *Core) IssuerAccepted(akid, rawIssuer []byte) bool {
	return c.issuerAccepted(&x509.Certificate{AuthorityKeyId: akid, RawIssuer: rawIssuer})
}

// issuedByRetired reports whether leaf names a retired node CA
// (ca.Bundle.RetiredNodeCAs) as its issuer.
func (c *Core) issuedByRetired(leaf *x509.Certificate) bool {
	b := c.cfg.Bundle.Now()
	if b == nil {
		return false
	}
	for _, ca := range b.RetiredNodeCAs {
		if bytes.Equal(leaf.AuthorityKeyId, ca.SubjectKeyId) || len(ca.SubjectKeyId) == 0 && bytes.Equal(leaf.RawIssuer, ca.RawSubject) {
			return true
		}
	}
	return false
}

// issuerAccepted reports whether leaf names an accepted node CA as its
// issuer. The row matched byte for byte, so JoinService signed it; only
// which CA is in question, and the authority key id answers that without a
// signature check.
func (c *Core) issuerAccepted(leaf *x509.Certificate) bool {
	b := c.cfg.Bundle.Now()
	if b == nil {
		return false
	}
	for _, ca := range b.TrustedNodeCAs() {
		if bytes.Equal(leaf.AuthorityKeyId, ca.SubjectKeyId) || len(ca.SubjectKeyId) == 0 && bytes.Equal(leaf.RawIssuer, ca.RawSubject) {
			return true
		}
	}
	return false
}
