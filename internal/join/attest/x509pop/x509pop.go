// Package x509pop is the x509pop attestor (R10.5): a machine whose node
// certificate expired while it was offline re-joins as the same node, within
// MaxExpiredFor of the expiry, by proving possession of that certificate's
// key. A certificate that is still valid renews instead (R13).
//
// The evidence names the node: the leaf must be byte for byte a node_certs
// row of the node's current identity generation, unrevoked, chaining to the
// node CA, of a node that is not retired. The admission carries that node
// (attest.Admission.NodeID), and JoinService re-joins it. Admit only reads;
// the replay record (the renew_proofs table, under its own hash domain) is
// written by Spend, last in the admission transaction.
package x509pop

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/clock"
	"github.com/better-compute/better-compute/internal/join/attest"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
)

// Name of the attestor.
const Name = "x509pop"

// Windows of the evidence.
const (
	// MaxExpiredFor is how long after its expiry a certificate still
	// re-joins its node.
	MaxExpiredFor = 7 * 24 * time.Hour
	// ClockSkew is how far the daemon's client time may be from the
	// server's clock.
	ClockSkew = 60 * time.Second
	// ProofWindow is how long used evidence is remembered: twice ClockSkew
	// covers every later use the clock check lets through.
	ProofWindow = 2 * ClockSkew
)

// proofDomain separates x509pop replay records from renewal proofs in the
// shared renew_proofs table: the two messages have the same layout.
const proofDomain = "better-compute x509pop proof v1\x00"

// tpmAKStatement starts the statement naming the TPM attestation key that
// holds a node key (R7.2).
const tpmAKStatement = pki.StatementPrefix + "tpm-ak:"

// Config lists the attestor's dependencies.
type Config struct {
	// NodeCA is the CA every node certificate chains to; nil refuses every
	// join (JoinService answers INVALID_CONFIG before that without a PKI).
	NodeCA *x509.Certificate
	// Clock is JoinService's clock (nil: the wall clock).
	Clock clock.Clock
}

// Attestor admits a machine back into its node with an expired certificate.
type Attestor struct {
	ca    *x509.Certificate
	clock clock.Clock
}

// New returns the attestor.
func New(cfg Config) *Attestor {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	return &Attestor{ca: cfg.NodeCA, clock: cfg.Clock}
}

// Name implements attest.Attestor.
func (*Attestor) Name() string { return Name }

// Admit implements attest.Attestor.
func (a *Attestor) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	if in.Token != "" {
		return nil, attest.Refuse("token-present", "")
	}
	ev := in.X509Pop
	if ev == nil {
		return nil, attest.Refuse("evidence-missing", "")
	}
	if len(ev.Chain) == 0 {
		return nil, attest.Refuse("chain-missing", "")
	}
	leaf, err := x509.ParseCertificate(ev.Chain[0])
	if err != nil {
		return nil, attest.Refuse("leaf-invalid", "")
	}
	now := a.clock.Now()
	row, err := tx.GetNodeCert(ctx, pki.SerialHex(leaf))
	if errors.Is(err, store.ErrNotFound) || err == nil && !bytes.Equal(row.DER, ev.Chain[0]) {
		// Not a certificate JoinService issued, or an altered copy of one.
		return nil, attest.Refuse("leaf-unknown", "")
	} else if err != nil {
		return nil, err
	}
	if pki.VerifyX509Pop(leaf.PublicKey, in.RequestDigest, ev.Sig) != nil {
		return nil, attest.Refuse("sig-invalid", "")
	}
	n, err := tx.GetNode(ctx, row.NodeID)
	if err != nil {
		return nil, fmt.Errorf("read the leaf's node: %w", err)
	}
	// The caller proved the key of one of this node's certificates: from
	// here refusals go to the node's owner.
	ref := func(reason string) (*attest.Admission, error) { return nil, attest.Refuse(reason, n.TenantID) }
	switch {
	case n.State == store.NodeRetired:
		return ref("node-retired")
	case row.IdentityGeneration != n.IdentityGeneration:
		return ref("leaf-generation")
	case row.RevokedAt != nil:
		return ref("leaf-revoked")
	case !a.chains(leaf):
		return ref("leaf-chain")
	case now.Before(row.NotAfter):
		// Still valid: the node renews it (R13) instead.
		return ref("cert-not-expired")
	case now.Sub(row.NotAfter) >= MaxExpiredFor:
		return ref("cert-expired-too-long")
	}
	if skew := now.Sub(time.UnixMilli(ev.ClientTimeMS)); skew > ClockSkew || skew < -ClockSkew {
		return ref("client-time")
	}
	if family(row.Role) != in.Role {
		return ref("role-mismatch")
	}
	var kinds, statements []string
	if err := json.Unmarshal(row.AllowedKinds, &kinds); err != nil {
		return nil, fmt.Errorf("read the leaf's allowed kinds: %w", err)
	}
	if err := json.Unmarshal(row.Statements, &statements); err != nil {
		return nil, fmt.Errorf("read the leaf's statements: %w", err)
	}
	for _, st := range statements {
		// The new key would inherit a statement that its key lives in the
		// TPM, with nothing to prove it: never downgrade. Such a node joins
		// again with the tpm attestor.
		if strings.HasPrefix(st, tpmAKStatement) {
			return ref("key-attestation-missing")
		}
	}
	// SECURITY: replays are recognised by the signed message, not by the
	// signature bytes, which anyone who saw them can re-encode.
	proof := ProofHash(in.RequestDigest)
	adm := &attest.Admission{
		TenantID: n.TenantID, PoolID: n.PoolID, SiteID: n.SiteID, Role: row.Role, NodeID: n.ID,
		NodeKey: "unattested", AllowedKinds: kinds, Statements: statements,
		Spend: func(ctx context.Context, tx *store.Tx) error {
			fresh, err := tx.UseRenewProof(ctx, proof, n.ID, now, ProofWindow)
			if err != nil {
				return err
			}
			if !fresh {
				return attest.Refuse("proof-replayed", n.TenantID)
			}
			return nil
		},
	}
	// A re-join never lengthens what an attestor shortened.
	if prior := row.NotAfter.Sub(row.NotBefore); prior > 0 {
		adm.MaxTTL = prior
	}
	return adm, nil
}

// ProofHash is the replay record of x509pop evidence in the renew_proofs
// table: the hash of the signed message under a domain of its own, so it
// never equals a renewal proof's record.
func ProofHash(reqDigest []byte) []byte {
	sum := sha256.Sum256(append([]byte(proofDomain), pki.X509PopMessage(reqDigest)...))
	return sum[:]
}

// chains reports whether leaf chains to the node CA for client auth, as of
// just before it expired: the leaf has expired by design.
func (a *Attestor) chains(leaf *x509.Certificate) bool {
	if a.ca == nil {
		return false
	}
	roots := x509.NewCertPool()
	roots.AddCert(a.ca)
	_, err := leaf.Verify(x509.VerifyOptions{
		Roots: roots, CurrentTime: leaf.NotAfter.Add(-time.Second), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	return err == nil
}

// family is the requested role behind a certificate role: node-tenant is a
// node that a hosted token made tenant-controlled.
func family(role string) string {
	if role == pki.RoleNodeTenant {
		return pki.RoleNode
	}
	return role
}
