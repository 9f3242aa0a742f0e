// Package x509pop is the x509pop attestor (R10.5): a machine whose node
// certificate expired while it was offline re-joins as the same node, within
// MaxExpiredFor of the expiry, by proving possession of that certificate's
// key. A certificate that is still valid renews instead (R13).
//
// The evidence names the node: the leaf goes through the identity core's
// one certificate check (byte for byte a node_certs row of the node's
// current identity generation, unrevoked, its newest, of a node that is not
// retired), and chains to the node CA. Its signature covers the whole
// request's digest. The admission carries that node
// (attest.Admission.NodeID), and JoinService re-joins it. Admit only reads;
// the replay record (the renew_proofs table, under its own hash domain) is
// written by Spend, last in the admission transaction.
package x509pop

import (
	"context"
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Name of the attestor.
const Name = wire.AttestorX509Pop

// Windows of the evidence.
const (
	// MaxExpiredFor is how long after its expiry a certificate still
	// re-joins its node.
	MaxExpiredFor = nodeident.MaxExpiredFor
	// ClockSkew is how far the daemon's client time may be from the
	// server's clock.
	ClockSkew = 60 * time.Second
	// ProofWindow is how long used evidence is remembered: twice ClockSkew
	// covers every later use the clock check lets through.
	ProofWindow = 2 * ClockSkew
)

// proofDomain separates x509pop replay records from renewal proofs in the
// shared renew_proofs table.
const proofDomain = "better-compute x509pop proof v1\x00"

// Config lists the attestor's dependencies.
type Config struct {
	// Core is the identity core that checks the presented certificate.
	Core *nodeident.Core
	// NodeCAs returns the CAs a node certificate may chain to (the current
	// node CA and, while it rotates, the next and previous ones: R16.1);
	// none refuses every join (JoinService answers INVALID_CONFIG before
	// that without a PKI).
	NodeCAs func() []*x509.Certificate
	// Clock is JoinService's clock (nil: the core's).
	Clock clock.Clock
}

// Attestor admits a machine back into its node with an expired certificate.
type Attestor struct {
	core  *nodeident.Core
	cas   func() []*x509.Certificate
	clock clock.Clock
}

// New returns the attestor.
func New(cfg Config) *Attestor {
	if cfg.Clock == nil {
		cfg.Clock = cfg.Core.Clock()
	}
	if cfg.NodeCAs == nil {
		cfg.NodeCAs = func() []*x509.Certificate { return nil }
	}
	return &Attestor{core: cfg.Core, cas: cfg.NodeCAs, clock: cfg.Clock}
}

// Name implements attest.Attestor.
func (*Attestor) Name() string { return Name }

// Admit implements attest.Attestor. The presented leaf goes through the
// identity core's one check (ForRejoin): it must be the node's newest
// certificate, so a key from a backup taken before a renewal re-joins
// nothing; the evidence signature covers the whole request's digest.
func (a *Attestor) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	if in.Token != "" {
		return nil, attest.Refuse("token-present", "")
	}
	var ev agentv1.X509Pop
	if len(in.Evidence) == 0 || proto.Unmarshal(in.Evidence, &ev) != nil {
		return nil, attest.Refuse("evidence-missing", "")
	}
	if len(ev.GetChain()) == 0 {
		return nil, attest.Refuse("chain-missing", "")
	}
	c, err := a.core.Check(ctx, tx, nodeident.Presented{
		DER:         ev.GetChain()[0],
		Prove:       func(pub crypto.PublicKey) error { return pki.VerifyX509Pop(pub, in.RequestDigest, ev.GetSig()) },
		ProofReason: "sig-invalid",
	}, nodeident.ForRejoin)
	if err != nil {
		return nil, err
	}
	n, row := c.Node, c.Row
	// The caller proved the key of this node's newest certificate: from
	// here refusals go to the node's owner.
	ref := func(reason string) (*attest.Admission, error) {
		return nil, &attest.Refusal{Reason: reason, TenantID: n.TenantID, NodeID: n.ID, Serial: row.Serial}
	}
	now := a.clock.Now()
	if !a.chains(c.Leaf) {
		return ref("cert-chain")
	}
	if skew := now.Sub(time.UnixMilli(ev.GetClientTimeUnixMs())); skew > ClockSkew || skew < -ClockSkew {
		return ref("client-time")
	}
	if nodeident.Family(row.Role) != in.Role {
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
		if tpmverify.IsStatement(st) {
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
	cas := a.cas()
	if len(cas) == 0 {
		return false
	}
	roots := x509.NewCertPool()
	for _, c := range cas {
		if c != nil {
			roots.AddCert(c)
		}
	}
	_, err := leaf.Verify(x509.VerifyOptions{
		Roots: roots, CurrentTime: leaf.NotAfter.Add(-time.Second), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	return err == nil
}
