// Package join is JoinService: it checks a machine's evidence through an
// attestor, decides (decide, a pure function) whether it joins as a new
// node, reclaims its node or re-joins it, and applies that in one database
// transaction, so any refusal leaves nothing behind and spends no token
// use. Certificates are issued and refusals recorded by the identity core
// (internal/controlplane/nodeident), shared with renewal and sessions.
//
// SECURITY: the gateway relays every byte. The seal (or an attestor's own
// signature) covers a digest of the whole request (pki.JoinRequestDigest),
// so claims, role, node id and evidence cannot be changed on the way; a
// request that arrives again gets the answer stored for it (R4.9), so a
// retry after a lost answer recovers the certificate and a replay gains a
// certificate for a key it does not hold and nothing else. The daemon
// learns only "Join refused"; the reason is recorded as a
// security.join.refused event.
package join

import (
	"context"
	"crypto/ecdsa"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// DefaultAttestor is the attestor of a request that names none.
const DefaultAttestor = wire.AttestorJoinToken

// UnknownAttestor names, in refusal events, a request for an attestor that
// is not configured.
const UnknownAttestor = "unknown"

// Certificate lifetimes (R7.1), kept here for callers of this package.
const (
	MaxCertTTL        = nodeident.MaxCertTTL
	MaxRamdiskCertTTL = nodeident.MaxRamdiskCertTTL
)

// AnswerRetention is how long the answer to a join request is kept for the
// same request arriving again (R4.9). A seal is refused after
// pki.SealMaxAge, so a captured request replays for at most that long; bcd
// reseals the very same request when it retries, and gets the stored
// answer for as long as this, the longest a node certificate lives.
const AnswerRetention = 24 * time.Hour

// WorkAdopt is the work kind that has the controllers adopt a node. Joins
// no longer queue it (they adopt in their own transaction, R4.5); the
// controllers still take the items a previous release queued.
const WorkAdopt = "adopt"

// AdoptedBy is the actor of node.adopted audit rows: the controller, which
// adopted every node before joins adopted in their own transaction, so the
// audit log reads as it did.
const AdoptedBy = "controller"

// RecordAdopted writes the node.adopted event and its audit row for n, just
// moved to adopted in tx (R4.5, R14.1, R14.2): by a join in a pool without
// acceptance checks, or by a controller.
func RecordAdopted(ctx context.Context, tx *store.Tx, hub *events.Hub, n store.Node) error {
	ev, entry, err := adoptedFacts(n)
	if err != nil {
		return err
	}
	if err := events.Publish(ctx, tx, hub, ev); err != nil {
		return err
	}
	return events.Audit(ctx, tx, entry)
}

// adoptedFacts is node n's node.adopted event and its audit row.
func adoptedFacts(n store.Node) (events.Event, events.Entry, error) {
	// The event and the audit row carry the same data: encoded once, in
	// the key order a map had.
	data, err := json.Marshal(struct {
		IdentityGeneration int    `json:"identityGeneration"`
		NodeID             string `json:"nodeId"`
		PoolID             string `json:"poolId"`
	}{n.IdentityGeneration, n.ID, n.PoolID})
	if err != nil {
		return events.Event{}, events.Entry{}, fmt.Errorf("marshal adoption: %w", err)
	}
	return events.Event{TenantID: n.TenantID, Type: "node.adopted", Subject: n.ID, Data: json.RawMessage(data)},
		events.Entry{TenantID: n.TenantID, Actor: AdoptedBy, Action: "node.adopted", Resource: "compute-node/" + n.ID, Data: json.RawMessage(data)}, nil
}

// Config lists JoinService's dependencies.
type Config struct {
	DB *store.DB
	// Core is the identity core (issues certificates, records refusals).
	// Required.
	Core      *nodeident.Core
	Attestors attest.Registry
	Clock     clock.Clock
	Log       *slog.Logger
	Hub       *events.Hub
	// OnIdentityChanged, when set, is called after a reclaim or re-join
	// committed, with the node whose older certificates it revoked (the
	// session service ends that node's session).
	OnIdentityChanged func(nodeID string)
	// AfterCommit, when set, is called once an admission transaction
	// committed, before the answer is returned: a fault-injection seam for
	// tests of answers lost after the commit.
	AfterCommit func()
	// RetryAfter is what a deferral tells the daemon to wait before it asks
	// again; zero means DefaultRetryAfter.
	RetryAfter time.Duration
	// Limits bound the join requests unauthenticated callers can make
	// (R15.4); zero fields take their defaults.
	Limits RequestLimits
	// Metrics, when set, counts joins by outcome, renewals, token spends
	// and times the join's phases.
	Metrics *apimetrics.API
	// VouchWait is how long a discovery join waits for its site agent's
	// vouch to arrive (R10.4); zero means DefaultVouchWait.
	VouchWait time.Duration
}

// Service is JoinService.
type Service struct {
	cfg   Config
	db    *store.DB
	core  *nodeident.Core
	log   *slog.Logger
	clock clock.Clock
	// seals opens sealed tokens with the bundle's encryption keys, each
	// converted for ECDH once.
	seals *ca.SealOpeners
}

// New returns JoinService.
func New(cfg Config) (*Service, error) {
	if cfg.DB == nil {
		return nil, errors.New("join: a store is required")
	}
	if cfg.Core == nil {
		return nil, errors.New("join: the identity core is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = cfg.Core.Clock()
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.RetryAfter <= 0 {
		cfg.RetryAfter = DefaultRetryAfter
	}
	if cfg.VouchWait <= 0 {
		cfg.VouchWait = DefaultVouchWait
	}
	cfg.Limits = cfg.Limits.withDefaults()
	return &Service{cfg: cfg, db: cfg.DB, core: cfg.Core, log: cfg.Log, clock: cfg.Clock, seals: &ca.SealOpeners{}}, nil
}

// Peer is what the gateway says about the daemon's connection.
type Peer struct {
	Addr string
	// Cert is the DER leaf the daemon presented on its TLS connection to
	// the gateway (Renew only), nil when none. It is trusted as the
	// caller's mTLS identity only because the agent listener authenticates
	// the gateway; Renew still matches it against node_certs.
	Cert []byte
}

// errRefused is the only refusal the daemon ever sees.
var errRefused = errs.New(errs.AccessDenied, "Join refused")

// errRace is the answer to the loser of two racing joins of one machine.
var errRace = errs.New(errs.Conflict, "This machine joined concurrently; retry")

// joinRefusal is a refused join with what its event needs.
type joinRefusal struct {
	*nodeident.Refusal
	attestor, role string
	csrHash        []byte
	hwKey          hwid.HardwareKey
}

// Join admits a machine (R4).
func (s *Service) Join(ctx context.Context, req *agentv1.JoinRequest, peer Peer) (*agentv1.JoinResponse, error) {
	if s.core.Bundle() == nil {
		return nil, nodeident.ErrNotConfigured
	}
	m := s.cfg.Metrics
	start := s.clock.Now()
	in, pub, ref := s.check(req)
	m.Phase(telemetry.PhaseCheck, s.clock.Now().Sub(start))
	if ref != nil {
		m.Join(ref.attestor, ref.role, telemetry.OutcomeRefused, ref.Reason)
		s.refused(ctx, ref)
		return nil, errRefused
	}
	in.PeerAddr = peer.Addr
	att := s.cfg.Attestors[attestorName(req.GetAttestor())]
	var res *agentv1.JoinResponse
	var err error
	outcome := telemetry.OutcomeAdmitted
	if c, ok := att.(attest.Challenger); ok && len(in.Answer) == 0 {
		// The first leg of a two-leg attestor: a challenge for the
		// machine, outside any transaction; nothing is read, written,
		// issued or spent, and a challenge is never stored (R4.9).
		var ch []byte
		if ch, err = c.Challenge(ctx, in); err == nil {
			res, outcome = &agentv1.JoinResponse{Challenge: ch}, telemetry.OutcomeChallenged
		}
	} else if att.Name() == wire.AttestorDiscovery {
		res, outcome, err = s.admitVouched(ctx, att, in, pub, req, peer)
	} else {
		start = s.clock.Now()
		res, outcome, err = s.admit(ctx, att, in, pub, req, peer)
		m.Phase(telemetry.PhaseAdmit, s.clock.Now().Sub(start))
	}
	var r *nodeident.Refusal
	switch {
	case err == nil:
		m.Join(att.Name(), in.Role, outcome, "")
		return res, nil
	case errors.As(err, &r):
		m.Join(att.Name(), in.Role, telemetry.OutcomeRefused, r.Reason)
		s.refused(ctx, &joinRefusal{Refusal: r, attestor: att.Name(), role: in.Role, csrHash: in.CSRSHA256, hwKey: in.Key})
		return nil, errRefused
	case errors.Is(err, errRace):
		m.Join(att.Name(), in.Role, telemetry.OutcomeConflict, "")
		return nil, errRace
	default:
		m.Join(att.Name(), in.Role, telemetry.OutcomeError, "")
		return nil, err
	}
}

func attestorName(a string) string {
	if a == "" {
		return DefaultAttestor
	}
	return a
}

// check parses and checks the request's shape before any database work:
// the attestor and role, the CSR (returning its key, whose signature it
// verified), the claims, and the seal, which must bind this very request
// (its digest) and be fresh.
func (s *Service) check(req *agentv1.JoinRequest) (*attest.Input, *ecdsa.PublicKey, *joinRefusal) {
	name := attestorName(req.GetAttestor())
	role := req.GetRole()
	if role == "" {
		role = pki.RoleNode
	}
	in := &attest.Input{Role: role, CSRSHA256: pki.CSRHash(req.GetCsr()), CSR: req.GetCsr(), RequestDigest: pki.JoinRequestDigest(req),
		Evidence: req.GetEvidence(), KeyAttestation: req.GetKeyAttestation(), RequestSig: req.GetRequestSig()}
	if ev := req.GetX509Pop(); ev != nil && len(in.Evidence) == 0 {
		// x509pop's evidence has a field of its own in the protocol; the
		// attestor gets it opaque like any other.
		in.Evidence, _ = proto.Marshal(ev)
	}
	in.Answer = req.GetChallengeResponse()
	ref := func(reason string) *joinRefusal {
		return &joinRefusal{Refusal: nodeident.Refuse(reason, ""), attestor: name, role: role, csrHash: in.CSRSHA256, hwKey: in.Key}
	}
	if _, ok := s.cfg.Attestors[name]; !ok {
		// The requested name is the caller's text: recording it would let
		// a caller pick its own rate-limit key (and write what it likes
		// into the root tenant's stream), so the refusal is filed under
		// one fixed name.
		name = UnknownAttestor
		return nil, nil, ref("attestor-unknown")
	}
	if role != pki.RoleNode && role != pki.RoleSite && role != pki.RoleRamdisk {
		// Like the attestor name, the caller's text is not recorded.
		role = "invalid"
		return nil, nil, ref("role-invalid")
	}
	if req.GetNodeId() != "" && !ids.Valid(ids.Node, req.GetNodeId()) {
		return nil, nil, ref("node-id-invalid")
	}
	pub, err := pki.ParseCSR(req.GetCsr())
	if err != nil {
		return nil, nil, ref("csr-invalid")
	}
	c := req.GetClaims()
	norm, err := hwid.Normalize(hwid.Claims{
		ProductUUID: c.GetProductUuid(), ProductSerial: c.GetProductSerial(), BoardSerial: c.GetBoardSerial(), ChassisSerial: c.GetChassisSerial(),
		MACs: c.GetMacs(), GPUUUIDs: c.GetGpuUuids(), Hostname: c.GetHostname(),
	})
	if err != nil {
		var ce *hwid.ClaimError
		if errors.As(err, &ce) {
			return nil, nil, ref(ce.Reason)
		}
		return nil, nil, ref("claims-invalid")
	}
	in.Claims, in.Key = norm, norm.Key()
	if sealed := req.GetSealedToken(); sealed != "" {
		// Join checked the bundle is configured (R4.8).
		start := s.clock.Now()
		tok, err := s.seals.Open(s.core.Bundle().Now().OpeningKeys(), sealed, req.GetCsr(), in.RequestDigest, start)
		s.cfg.Metrics.Phase(telemetry.PhaseSeal, s.clock.Now().Sub(start))
		if err != nil {
			reason, ok := ca.SealReason(err)
			if !ok {
				reason = "seal-invalid"
			}
			return nil, nil, ref(reason)
		}
		in.Token = tok
	}
	return in, pub, nil
}

// admission is one join's work inside the admission transaction: what the
// gather phase read, and what the later phases need of the request.
type admission struct {
	att        attest.Attestor
	adm        *attest.Admission
	in         *attest.Input
	pub        *ecdsa.PublicKey
	peer       Peer
	claims     hwid.Claims
	claimsJSON []byte
	spki       []byte
	sit        situation
	// elsewhere are other tenants' nodes with the same hardware key.
	elsewhere []store.Node
}

// admitted is what the admission transaction decided: an answer, or a
// join request to wait on, and the node whose identity changed.
type admitted struct {
	res      *agentv1.JoinResponse
	changed  string             // a reclaimed or re-joined node
	waiting  *store.JoinRequest // the join request a deferred join waits on
	waitRole string
}

// admit runs the admission transaction in phases: the attestor's
// admission, gather (the reads decide needs), decide (pure), the approval
// check of a deferred join, apply (the node and its certificate), record
// (events, audit, the stored answer), and the attestor's spend last. Its
// statements are ordered for the hot token row (PostgreSQL): the spend
// locks it, so it is held only from the spend to the commit.
// The outcome is telemetry.OutcomeAdmitted or telemetry.OutcomeDeferred.
func (s *Service) admit(ctx context.Context, att attest.Attestor, in *attest.Input, pub *ecdsa.PublicKey, req *agentv1.JoinRequest, peer Peer) (*agentv1.JoinResponse, string, error) {
	// Neither depends on the transaction, and a retried transaction reuses
	// them.
	a := &admission{att: att, in: in, pub: pub, peer: peer, claims: in.Claims.Claims()}
	var err error
	if a.claimsJSON, err = json.Marshal(a.claims); err != nil {
		return nil, "", fmt.Errorf("marshal claims: %w", err)
	}
	if a.spki, err = pki.PublicKeySPKIHash(pub); err != nil {
		return nil, "", err
	}
	var out admitted
	var last time.Time // the transaction's last statement (PhaseCommit)
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		defer func() { last = s.clock.Now() }()
		// R4.9: the same request again gets the answer stored for it and
		// spends nothing. It is not looked up here: an answer is stored in
		// this very transaction, before anything is spent, under a unique
		// request digest, so a request that was answered before cannot
		// commit again; it fails (a refusal, a race, or the digest's
		// unique violation) and the failure path below finds its answer.
		// The usual join pays no extra read.
		var err error
		out = admitted{}
		start := s.clock.Now()
		a.adm, err = att.Admit(ctx, tx, in)
		s.cfg.Metrics.Phase(telemetry.PhaseAttest, s.clock.Now().Sub(start))
		if err != nil {
			return err
		}
		if err := s.gather(ctx, tx, a, req.GetNodeId()); err != nil {
			return err
		}
		d, reason := decide(a.sit)
		if reason != "" {
			return attest.Refuse(reason, a.adm.TenantID)
		}
		// R10.1: a deferred join needs its approval; without one it waits
		// on a join request and nothing else is written.
		var consume string
		if ap := a.adm.Approval; ap != nil && (!ap.OnlyReclaims || a.sit.Existing != nil || a.sit.Requested != nil) {
			got, err := s.approval(ctx, tx, a.adm, att.Name(), in, a.claimsJSON, a.sit.Pool.SiteID, d, peerSource(peer.Addr))
			if err != nil {
				return err
			}
			if got.waiting != nil {
				out.waiting, out.waitRole = got.waiting, d.Role
				return nil
			}
			consume = got.consume
		}
		w, err := s.apply(ctx, tx, a, d, consume)
		if err != nil {
			return err
		}
		if err := s.record(ctx, tx, a, d, w); err != nil {
			return err
		}
		// R15.3: what the admission used (a vouch) now admits only this
		// node.
		if a.adm.Bind != nil {
			if err := a.adm.Bind(ctx, tx, w.node.ID); err != nil {
				return err
			}
		}
		// Last: spending may lock the token row until the commit.
		if a.adm.Spend != nil {
			if err := a.adm.Spend(ctx, tx); err != nil {
				return err
			}
			tx.AfterCommit(s.cfg.Metrics.TokenSpent)
		}
		out.res, out.changed = w.issued.Response, w.changed
		return nil
	})
	if err != nil {
		// R4.9: a request answered before (a retry after a lost answer, a
		// replay, the loser of a race with the very same request) gets
		// the stored answer, whatever made this attempt fail; anything
		// else keeps its failure.
		if prior, rerr := s.answerFor(ctx, in.RequestDigest); rerr == nil && prior != nil {
			return prior, telemetry.OutcomeAdmitted, nil
		}
		return nil, "", err
	}
	s.cfg.Metrics.Phase(telemetry.PhaseCommit, s.clock.Now().Sub(last))
	if s.cfg.AfterCommit != nil {
		s.cfg.AfterCommit()
	}
	if out.waiting != nil {
		// R10.1: a signed deferral, never stored as the request's answer:
		// the same request asks again until a person decided.
		res, err := s.core.Defer(in.CSRSHA256, out.waiting.SiteID, out.waitRole, out.waiting.ID, s.cfg.RetryAfter)
		return res, telemetry.OutcomeDeferred, err
	}
	if out.changed != "" && s.cfg.OnIdentityChanged != nil {
		s.cfg.OnIdentityChanged(out.changed)
	}
	return out.res, telemetry.OutcomeAdmitted, nil
}

// gather reads what decide needs (the gather phase): the pool, its site
// and policy, the root tenant, a node made ahead that the request names,
// and the node this machine already is.
func (s *Service) gather(ctx context.Context, tx *store.Tx, a *admission, requestedNodeID string) error {
	adm, in := a.adm, a.in
	pool, site, err := tx.GetPoolWithSite(ctx, adm.PoolID)
	if err != nil {
		return fmt.Errorf("read pool: %w", err)
	}
	policy, err := tenancy.ParsePolicy(pool.Policy)
	if err != nil {
		return err
	}
	root, err := s.core.RootTenant(ctx, tx)
	if err != nil {
		return err
	}
	a.sit = situation{Attestor: a.att.Name(), Adm: adm, Pool: pool, Site: site, Policy: policy, Root: root,
		Claims: in.Claims, Key: in.Key, RequestedNodeID: requestedNodeID}
	a.elsewhere = nil
	if id := requestedNodeID; id != "" && adm.NodeID == "" {
		// R11.3: a node made ahead of its machine (nodes.create).
		switch n, err := tx.GetNode(ctx, id); {
		case err == nil && n.State == store.NodePending:
			a.sit.Requested = &n
		case err != nil && !errors.Is(err, store.ErrNotFound):
			return err
		}
	}
	switch {
	case adm.NodeID != "":
		n, err := tx.GetNode(ctx, adm.NodeID)
		if err != nil {
			return fmt.Errorf("read the re-joining node: %w", err)
		}
		a.sit.Existing = &n
	case adm.ReclaimNodeID != "" && adm.AllowReclaim:
		// The attestor proved which node this machine is (R15.3).
		n, err := tx.GetNode(ctx, adm.ReclaimNodeID)
		if err != nil {
			return fmt.Errorf("read the node to reclaim: %w", err)
		}
		if n.TenantID == adm.TenantID && n.State != store.NodeRetired {
			a.sit.Existing = &n
		}
	case in.Key.Trusted && !in.Key.PlaceholderHardware():
		// Hardware keys are matched within the token's tenant: another
		// tenant's node never makes this a reclaim (nor refuses it).
		same, err := tx.NodesByHardwareKey(ctx, in.Key.Hash[:], 5)
		if err != nil {
			return err
		}
		for i := range same {
			if same[i].TenantID == adm.TenantID {
				a.sit.Existing = &same[i]
			} else {
				a.elsewhere = append(a.elsewhere, same[i])
			}
		}
	}
	if a.sit.Existing != nil {
		if a.sit.KeyIssued, err = tx.NodeKeyIssued(ctx, a.sit.Existing.ID, a.spki); err != nil {
			return err
		}
	}
	return nil
}

// written is what the apply phase wrote.
type written struct {
	node    store.Node
	issued  *nodeident.Issued
	revoked []string
	// revokeReason is why older certificates were revoked.
	revokeReason string
	// consumed is the join request the join consumed, "" when none.
	consumed string
	changed  string
	// adopted: the node was written adopted (a pool without acceptance
	// checks, R4.5).
	adopted bool
}

// apply writes the decision (the apply phase): the node (new, bound,
// reclaimed or re-joined, revoking its older certificates), the approval it
// consumes, and its certificate; the node's row holds its authorization
// projection.
func (s *Service) apply(ctx context.Context, tx *store.Tx, a *admission, d decision, consume string) (written, error) {
	adm, pool, tenant := a.adm, a.sit.Pool, a.adm.TenantID
	w := written{revokeReason: "reclaimed", consumed: consume}
	if d.Outcome == joinRejoin {
		w.revokeReason = "rejoined"
	}
	// R4.5: without acceptance checks the node is adopted in this very
	// transaction (record writes node.adopted after node.joined); with
	// them it stays adopting until its first Hello starts acceptance.
	state := store.NodeAdopting
	if w.adopted = a.sit.Policy.Acceptance == nil; w.adopted {
		state = store.NodeAdopted
	}
	n := store.Node{
		TenantID: tenant, SiteID: pool.SiteID, PoolID: pool.ID, Role: d.Role, State: state,
		HardwareKeyTrusted: d.Trusted, HardwareKey: d.HardwareKey, NodeKey: adm.NodeKey, Attestor: a.att.Name(),
		Hostname: a.claims.Hostname, Claims: a.claimsJSON, JoinTokenID: adm.JoinTokenID,
		// R1.3: the authorization projection, in the node's row.
		Authz: true,
	}
	var err error
	switch d.Outcome {
	case joinNew:
		n.ID, n.IdentityGeneration = ids.New(ids.Node, s.clock.Now()), 1
		if n, err = tx.InsertNode(ctx, n); err != nil {
			if store.IsUniqueViolation(err) {
				return w, errRace
			}
			return w, err
		}
	case joinBind:
		n.ID = d.NodeID
		if n, err = tx.BindPendingNode(ctx, n); errors.Is(err, store.ErrNotFound) || store.IsUniqueViolation(err) {
			return w, errRace
		} else if err != nil {
			return w, err
		}
	default:
		n.ID = d.NodeID
		if n, err = tx.ReclaimNode(ctx, n, a.sit.Existing.IdentityGeneration); errors.Is(err, store.ErrNotFound) {
			return w, errRace
		} else if err != nil {
			return w, err
		}
		if w.revoked, err = tx.RevokeNodeCerts(ctx, n.ID, n.IdentityGeneration, w.revokeReason); err != nil {
			return w, err
		}
		w.changed = n.ID
	}
	w.node = n
	if consume != "" {
		// R10.3: the approval admits exactly this one join.
		if err := tx.ConsumeJoinRequest(ctx, consume, n.ID, s.clock.Now()); errors.Is(err, store.ErrNotFound) {
			return w, attest.Refuse("join-request-consumed", tenant)
		} else if err != nil {
			return w, err
		}
	}
	start := s.clock.Now()
	w.issued, err = s.core.Issue(ctx, tx, nodeident.IssueParams{Pub: a.pub, CSRSHA256: a.in.CSRSHA256, Node: n, Role: d.Role,
		Statements: adm.Statements, AllowedKinds: adm.AllowedKinds, MaxTTL: adm.MaxTTL})
	s.cfg.Metrics.Phase(telemetry.PhaseSign, s.clock.Now().Sub(start))
	if err != nil {
		return w, err
	}
	return w, nil
}

// record writes what the join says about itself (the record phase): the
// revocations, a cross-tenant hardware-key conflict for the root tenant,
// the node.joined event and its audit row, node.adopted and its audit row
// when apply adopted the node, and the answer stored for the request
// digest (R4.9).
func (s *Service) record(ctx context.Context, tx *store.Tx, a *admission, d decision, w written) error {
	n := w.node
	evs, ents, err := joinFacts(a, d, w)
	if err != nil {
		return err
	}
	if w.adopted {
		ev, entry, err := adoptedFacts(n)
		if err != nil {
			return err
		}
		evs, ents = append(evs, ev), append(ents, entry)
	}
	// Every event in one insert and every audit row in another, in the
	// order they happened.
	if err := events.PublishAll(ctx, tx, s.cfg.Hub, evs...); err != nil {
		return err
	}
	if err := events.AuditAll(ctx, tx, ents...); err != nil {
		return err
	}
	raw, err := proto.Marshal(w.issued.Response)
	if err != nil {
		return fmt.Errorf("marshal join answer: %w", err)
	}
	if err := tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: a.in.RequestDigest, NodeID: n.ID, Response: raw, TTL: AnswerRetention}); err != nil {
		if store.IsUniqueViolation(err) {
			// The same request was answered before, or is being answered
			// concurrently: admit's failure path returns that answer.
			return errRace
		}
		return err
	}
	return nil
}

// joinFacts is what the join says about itself, in order: the
// revocations, a cross-tenant hardware-key conflict for the root tenant,
// and node.joined (or reclaimed, rejoined) with its audit row.
func joinFacts(a *admission, d decision, w written) ([]events.Event, []events.Entry, error) {
	n, pool, tenant, root := w.node, a.sit.Pool, a.adm.TenantID, a.sit.Root
	evs := make([]events.Event, 0, len(w.revoked)+3)
	for _, serial := range w.revoked {
		evs = append(evs, events.Event{TenantID: tenant, Type: "security.certificate-revoked", Subject: n.ID,
			Data: map[string]any{"nodeId": n.ID, "serial": serial, "reason": w.revokeReason}})
	}
	if len(a.elsewhere) > 0 && root != "" {
		// SECURITY: claims are self-reported, so a collision across
		// tenants says nothing either tenant may learn; the root
		// tenant (the platform) sees it.
		others := make([]map[string]string, len(a.elsewhere))
		for i, o := range a.elsewhere {
			others[i] = map[string]string{"nodeId": o.ID, "tenantId": o.TenantID}
		}
		evs = append(evs, events.Event{TenantID: root, Type: "security.hardware-key.conflict", Subject: n.ID,
			Data: map[string]any{"nodeId": n.ID, "tenantId": tenant, "hardwareKey": a.in.Key.Hex(), "others": others}})
	}
	reclaim, rejoin := d.Outcome == joinReclaim, d.Outcome == joinRejoin
	data, err := json.Marshal(joinedData{
		NodeID: n.ID, PoolID: pool.ID, SiteID: pool.SiteID, Role: d.Role, Attestor: a.att.Name(), Reclaim: reclaim,
		HardwareKeyTrusted: d.Trusted, CertSerial: w.issued.Cert.Serial, NodeKey: a.adm.NodeKey, IdentityGeneration: n.IdentityGeneration,
		JoinTokenID: a.adm.JoinTokenID, Hostname: n.Hostname, Peer: a.peer.Addr,
		JoinRequestID: w.consumed, MadeAhead: d.Outcome == joinBind, Rejoin: rejoin,
	})
	if err != nil {
		return nil, nil, fmt.Errorf("marshal join event: %w", err)
	}
	// The event and the audit row carry the same data: marshal it once.
	evs = append(evs, events.Event{TenantID: tenant, Type: "node.joined", Subject: n.ID, Data: json.RawMessage(data)})
	action := "node.joined"
	switch {
	case reclaim:
		action = "node.reclaimed"
	case rejoin:
		action = "node.rejoined"
	}
	ents := make([]events.Entry, 1, 2)
	ents[0] = events.Entry{TenantID: tenant, Actor: "node:" + n.ID, Action: action, Resource: "compute-node/" + n.ID, Data: json.RawMessage(data)}
	return evs, ents, nil
}

// joinedData is the data of a node.joined event and of its audit row. Its
// fields are in the order of their JSON names, so it encodes exactly as
// the map it replaces did (encoding/json sorts map keys); a struct's
// encoder is built once, where a map was sorted and boxed on every join.
type joinedData struct {
	Attestor           string `json:"attestor"`
	CertSerial         string `json:"certSerial"`
	HardwareKeyTrusted bool   `json:"hardwareKeyTrusted"`
	Hostname           string `json:"hostname"`
	IdentityGeneration int    `json:"identityGeneration"`
	JoinRequestID      string `json:"joinRequestId,omitempty"`
	JoinTokenID        string `json:"joinTokenId"`
	MadeAhead          bool   `json:"madeAhead,omitempty"`
	NodeID             string `json:"nodeId"`
	NodeKey            string `json:"nodeKey"`
	Peer               string `json:"peer"`
	PoolID             string `json:"poolId"`
	Reclaim            bool   `json:"reclaim"`
	Rejoin             bool   `json:"rejoin,omitempty"`
	Role               string `json:"role"`
	SiteID             string `json:"siteId"`
}

// storedAnswer returns the answer stored for a request digest, nil when
// there is none.
func storedAnswer(ctx context.Context, tx *store.Tx, digest []byte) (*agentv1.JoinResponse, error) {
	a, err := tx.GetJoinAnswer(ctx, digest)
	if errors.Is(err, store.ErrNotFound) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	var res agentv1.JoinResponse
	if err := proto.Unmarshal(a.Response, &res); err != nil {
		return nil, fmt.Errorf("read the stored join answer: %w", err)
	}
	return &res, nil
}

// answerFor reads the stored answer of a request (R4.9) so that it sees
// the answer of the twin that made this attempt fail (store.ReadLatest).
func (s *Service) answerFor(ctx context.Context, digest []byte) (*agentv1.JoinResponse, error) {
	var res *agentv1.JoinResponse
	err := s.db.ReadLatest(ctx, func(tx *store.Tx) error {
		var err error
		res, err = storedAnswer(ctx, tx, digest)
		return err
	})
	return res, err
}

// refused records a refused join (R4.7) through the identity core.
func (s *Service) refused(ctx context.Context, r *joinRefusal) {
	s.core.Refused(ctx, nodeident.Refused{Kind: nodeident.KindJoin, Attestor: r.attestor, Refusal: r.Refusal, Data: map[string]any{
		"role": r.role, "csrSha256": hex.EncodeToString(r.csrHash), "hardwareKey": r.hwKey.Hex(),
	}})
}
