// Package attest is the seam between JoinService and the attestors: what an
// attestor is given, what it answers, and the registry by name. An attestor
// decides whether the evidence admits the machine and into which pool, inside
// JoinService's admission transaction, and hands back what to spend at its
// end; it never sees the transport, and it
// refuses with a Refusal carrying a reason for the server-side record only.
package attest

import (
	"context"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/hwid"
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
	// RequestDigest is pki.JoinRequestDigest of the whole request: what a
	// seal, or an attestor's own signature, binds end to end so the relay
	// can change nothing.
	RequestDigest []byte
	// Evidence is the attestor's own evidence, opaque to JoinService: each
	// attestor parses its own.
	Evidence []byte
	// KeyAttestation is the request's key attestation (a TPM2_Certify of
	// the CSR key), when sent.
	KeyAttestation []byte
	// RequestSig is the request's request_sig: the node key's signature
	// over RequestDigest (the tpm attestor's binding, R15.1).
	RequestSig []byte
	// Answer is the request's answer to the challenge an earlier leg
	// returned (challenge_response), when it carries one.
	Answer []byte
	Claims hwid.Normalized
	Key    hwid.HardwareKey
	// PeerAddr is the daemon's address as the gateway saw it (ip:port,
	// join.Peer.Addr), "" when none was forwarded. SECURITY: it is the
	// gateway's word, trusted because the agent listener authenticates
	// the gateway; it is not covered by the request digest, and a
	// compromised gateway can lie about it.
	PeerAddr string
}

// Challenger is an attestor that needs a second leg (SPIRE's
// challenge/response, without the transport): for a request that carries
// no answer yet, JoinService calls Challenge instead of Admit, outside any
// transaction, and answers the machine with the challenge; the machine
// repeats the request with its answer, which Admit then checks. Challenge
// returns a *Refusal to refuse; it reads and writes nothing.
type Challenger interface {
	Challenge(ctx context.Context, in *Input) ([]byte, error)
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
	// ReclaimNodeID, when set (with AllowReclaim), is the node the attestor
	// proved this machine is from its own evidence (tpm: the same EK and
	// AK, R15.3), whatever its claims say: the join reclaims it under the
	// reclaim rules (same tenant, site and pool, a new key), as the next
	// identity generation of the same node.
	ReclaimNodeID string
	// Spend, when not nil, consumes what the admission uses up (one use of
	// a join token). JoinService runs it as the last statement of the
	// admission transaction, after every insert and after signing: on
	// PostgreSQL it locks a row that every join with the same token
	// shares, and a row lock is held until COMMIT, so spending last holds
	// that hot row only from the spend to the commit instead of through the
	// whole join. It returns a *Refusal when nothing is left to spend (the
	// transaction then rolls back, as for any refusal).
	Spend func(ctx context.Context, tx *store.Tx) error
	// Bind, when not nil, ties what the admission used to the node it
	// admitted (discovery: the vouch admits only this node, R15.3).
	// JoinService runs it with the node's id once the node is written,
	// just before Spend, so a lock it takes is held only to the commit. It
	// returns a *Refusal when what it binds is already another node's.
	Bind func(ctx context.Context, tx *store.Tx, nodeID string) error
	// Approval, when set, makes this join wait for a person (R10.1): the
	// attestor admits the machine only through an approved join request.
	// JoinService then admits the join that presents the approved CSR and
	// consumes the request in the admission transaction; otherwise it
	// records (or refreshes) the machine's request and answers a signed
	// deferral: nothing issued, nothing spent.
	Approval *Approval
}

// Approval is what a deferring attestor saw, for the join request (R10.2).
type Approval struct {
	// MachineKey keys the machine's one open request: "hw:<hex>" for a
	// trusted hardware key, "ek:<hex>" for a TPM endorsement key hash,
	// else "mac:<site>:<mac>". Use MachineKeyFor.
	MachineKey string
	// EKHash, EKCert (store.EKCertAbsent, …), EKCertSubject, EKCertIssuer
	// and AKName are what the tpm attestor established (R22.1).
	EKHash                              []byte
	EKCert, EKCertSubject, EKCertIssuer string
	AKName                              []byte
	MAC, IP                             string
	WorkflowID                          string
	VouchedBy                           string
	BootLeaseEpoch                      int64
	// OnlyReclaims defers only a join that would take a node that already
	// exists (a trusted hardware key matching a node of the tenant, or a
	// node made ahead that the request names), and admits a new machine at
	// once: discovery's "never" mode, where an unknown machine needs no
	// person but taking a node still does (R15.3).
	OnlyReclaims bool
}

// Refusal is a refused join. Reason is recorded server-side as
// <attestor>:<reason>; the daemon only ever sees "Join refused". TenantID
// routes the refusal event: the token's tenant once its secret verified,
// else "" (the root tenant), so an unauthenticated caller cannot write into
// another tenant's stream. It is the identity core's one refusal type.
type Refusal = nodeident.Refusal

// Refuse returns a Refusal.
func Refuse(reason, tenantID string) *Refusal { return nodeident.Refuse(reason, tenantID) }

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

// MachineKeyFor is the key of a machine's join request (R10.2): its trusted
// hardware key, else its TPM endorsement key hash, else its site and MAC.
func MachineKeyFor(key hwid.HardwareKey, ekHash []byte, siteID, mac string) string {
	switch {
	case key.Trusted && !key.PlaceholderHardware():
		return "hw:" + key.Hex()
	case len(ekHash) > 0:
		return "ek:" + hex.EncodeToString(ekHash)
	default:
		return "mac:" + siteID + ":" + mac
	}
}
