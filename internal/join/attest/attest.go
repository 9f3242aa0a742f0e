// Package attest is the seam between JoinService and the attestors: what an
// attestor is given, what it answers, and the registry by name. An attestor
// decides whether the evidence admits the machine and into which pool, inside
// JoinService's admission transaction, and hands back what to spend at its
// end; it never sees the transport, and it
// refuses with a Refusal carrying a reason for the server-side record only.
package attest

import (
	"context"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/hwid"
	"github.com/better-compute/better-compute/internal/store"
)

// Input is the evidence of one join, already parsed and checked for shape.
type Input struct {
	// Role requested by the daemon ("node" when it asked for none).
	Role string
	// Token is the opened join token (bearer form), when the daemon sent a
	// sealed one.
	Token string
	// CSRSHA256 is the hash of the daemon's certificate request.
	CSRSHA256 []byte
	// CSR is the daemon's certificate request (DER), whose signature
	// JoinService verified.
	CSR []byte
	// RequestDigest is pki.JoinRequestDigest of the whole request: what the
	// seal's req header and x509pop's signature bind (R4.2).
	RequestDigest []byte
	// X509Pop is the x509pop evidence, when the daemon sent some.
	X509Pop *X509Pop
	Claims  hwid.Normalized
	Key     hwid.HardwareKey
}

// X509Pop is the x509pop attestor's evidence (R10.5): an expired node
// certificate chain, leaf first, and a signature by the leaf's key over
// pki.X509PopMessage of the request digest (which covers ClientTimeMS).
type X509Pop struct {
	Chain        [][]byte
	ClientTimeMS int64
	Sig          []byte
}

// Admission is an attestor's yes: where the machine goes and what its
// certificate may say.
type Admission struct {
	TenantID     string
	PoolID       string
	SiteID       string
	Role         string
	Expect       hwid.Expect
	AllowReclaim bool
	Hosted       string
	// JoinTokenID is the token spent, if any.
	JoinTokenID string
	// NodeKey is "tpm" when the attestor proved the node key lives in the
	// machine's TPM, else "unattested".
	NodeKey string
	// AllowedKinds restricts the command kinds the certificate accepts
	// (empty: no restriction).
	AllowedKinds []string
	// Statements are urn:bc: URI SANs the attestor vouches for.
	Statements []string
	// MaxTTL shortens the certificate when non-zero.
	MaxTTL time.Duration
	// NodeID, when set, re-joins that node (x509pop, R10.5): JoinService
	// keeps its id, moves it to its next identity generation and revokes
	// every older certificate. The attestor has named the node from its
	// evidence, so the expect, placeholder and hardware-key reclaim rules
	// do not apply; TenantID, PoolID and SiteID must be the node's.
	NodeID string
	// Spend, when not nil, consumes what the admission uses up (one use of
	// a join token). JoinService runs it as the last statement of the
	// admission transaction, after every insert and after signing: on
	// PostgreSQL it locks a row that every join with the same token
	// shares, and a row lock is held until COMMIT, so spending last holds
	// that hot row only from the spend to the commit instead of through the
	// whole join. It returns a *Refusal when nothing is left to spend (the
	// transaction then rolls back, as for any refusal).
	Spend func(ctx context.Context, tx *store.Tx) error
}

// Refusal is a refused join. Reason is recorded server-side as
// <attestor>:<reason>; the daemon only ever sees "Join refused".
type Refusal struct {
	Reason string
	// TenantID routes the refusal event: the token's tenant once its secret
	// verified, else "" (the root tenant), so an unauthenticated caller
	// cannot write into another tenant's stream.
	TenantID string
}

func (r *Refusal) Error() string { return "join refused: " + r.Reason }

// Refuse returns a Refusal.
func Refuse(reason, tenantID string) *Refusal { return &Refusal{Reason: reason, TenantID: tenantID} }

// Attestor checks one kind of evidence.
type Attestor interface {
	// Name is the attestor's name in requests, events and pool policy.
	Name() string
	// Admit runs inside the admission transaction. It returns a *Refusal to
	// refuse; any other error is internal. It only reads: whatever it
	// locks or writes it leaves to Admission.Spend, so that no row is
	// locked while the rest of the join runs.
	Admit(ctx context.Context, tx *store.Tx, in *Input) (*Admission, error)
}

// Registry holds the configured attestors by name.
type Registry map[string]Attestor

// NewRegistry builds a registry, refusing duplicate names.
func NewRegistry(as ...Attestor) (Registry, error) {
	r := Registry{}
	for _, a := range as {
		if _, dup := r[a.Name()]; dup {
			return nil, fmt.Errorf("attestor %q registered twice", a.Name())
		}
		r[a.Name()] = a
	}
	return r, nil
}
