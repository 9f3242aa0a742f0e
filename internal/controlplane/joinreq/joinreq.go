// Package joinreq owns join requests through the operator API (R10.1–R10.3):
// listing a pool's requests and approving or rejecting a pending one,
// decided on the pool like join tokens (compute:join-requests:read,
// :approve, :reject). An approval admits exactly one join until it runs
// out; JoinService (internal/controlplane/join) records the requests, refreshes them and
// consumes approvals inside the join transaction, through the store.
//
// A request shows what its attestor established (evidence) apart from the
// machine's claims (R22.1), and what approving it does (its effect: a new
// node, or the node it takes over, with that node as recorded). Approving a
// reclaim needs the taken node acknowledged, and an approval that names
// the version it was shown is refused once the request changed (R22.2).
//
// The event data of every join request event (created, refreshed, approved,
// rejected) is built in one place, Published.
package joinreq

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"time"
	"unicode"

	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// Limits of a decision.
const (
	// MinTTL and MaxTTL bound how long an approval admits the retry.
	MinTTL = time.Minute
	MaxTTL = 24 * time.Hour
	// MaxReason bounds a decision's reason, in bytes.
	MaxReason = 256
)

// Event types of join requests.
const (
	EventCreated   = "security.join-request.created"
	EventRefreshed = "security.join-request.refreshed"
	EventApproved  = "security.join-request.approved"
	EventRejected  = "security.join-request.rejected"
)

// StateAll asks List for requests in every state.
const StateAll = "all"

// States a request is shown in.
var States = []string{store.JoinRequestPending, store.JoinRequestApproved, store.JoinRequestRejected, store.JoinRequestConsumed, store.JoinRequestExpired}

// Resource names a join request (audit rows).
func Resource(id string) string { return "compute-join-request/" + id }

// State tells the state a request is shown in at now: an approved request
// whose approval ran out unused (approved_until at or before now) is
// expired, whether or not that was stored yet.
func State(r store.JoinRequest, now time.Time) string {
	if r.State == store.JoinRequestApproved && r.ApprovedUntil != nil && !r.ApprovedUntil.After(now) {
		return store.JoinRequestExpired
	}
	return r.State
}

// Published is the data of a join request event: what the attestor saw
// (request, pool, site, attestor, MAC, hardware key and CSR hash in hex)
// and the decision (ttlSeconds, reason, decidedBy; zero and empty until
// decided). It is the one place that data is built.
func Published(r store.JoinRequest) map[string]any {
	var ttl int64
	if r.ApprovedUntil != nil && r.DecidedAt != nil {
		ttl = int64(r.ApprovedUntil.Sub(*r.DecidedAt) / time.Second)
	}
	d := map[string]any{
		"requestId": r.ID, "poolId": r.PoolID, "siteId": r.SiteID, "attestor": r.Attestor, "role": r.Role, "state": r.State, "mac": r.MAC,
		"ip": r.IP, "workflowId": r.WorkflowID, "vouchedBy": r.VouchedBy, "bootLeaseEpoch": r.BootLeaseEpoch,
		"hardwareKey": hex.EncodeToString(r.HardwareKey), "ekSha256": hex.EncodeToString(r.EKHash), "csrSha256": hex.EncodeToString(r.CSRSHA256),
		"ttlSeconds": ttl, "reason": r.Reason, "decidedBy": r.DecidedBy,
	}
	if len(r.Claims) > 0 && json.Valid(r.Claims) {
		d["claims"] = json.RawMessage(r.Claims)
	}
	if r.NodeID != "" {
		d["nodeId"] = r.NodeID
	}
	if r.Attestor == "tpm" || r.EKCert != "" {
		d["ekCertificate"], d["ekCertificateSubject"], d["ekCertificateIssuer"] = r.EKCert, r.EKCertSubject, r.EKCertIssuer
		d["akName"] = hex.EncodeToString(r.AKName)
	}
	if r.Effect != "" {
		d["effect"] = r.Effect
	}
	if r.EffectNodeID != "" {
		d["effectNodeId"] = r.EffectNodeID
	}
	if r.AcknowledgedNodeID != "" {
		d["acknowledgedReclaimNodeId"] = r.AcknowledgedNodeID
	}
	d["version"] = Version(r)
	return d
}

// Version names what a person is shown of a request (R22.2): a digest of
// everything a refresh may change (CSR, claims, evidence, effect) and
// nothing a decision changes. An approval that passes the version it was
// shown is refused once a refresh changed any of it.
func Version(r store.JoinRequest) string {
	h := sha256.New()
	field := func(b []byte) {
		h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(b))))
		h.Write(b)
	}
	for _, b := range [][]byte{[]byte("better-compute join request version v1"), []byte(r.ID), r.CSRSHA256, r.Claims, r.HardwareKey,
		r.EKHash, []byte(r.EKCert), []byte(r.EKCertSubject), []byte(r.EKCertIssuer), r.AKName,
		[]byte(r.MAC), []byte(r.IP), []byte(r.WorkflowID), []byte(r.VouchedBy), binary.BigEndian.AppendUint64(nil, uint64(r.BootLeaseEpoch)),
		[]byte(r.Source), []byte(r.PoolID), []byte(r.Role), []byte(r.Effect), []byte(r.EffectNodeID)} {
		field(b)
	}
	return "v1-" + hex.EncodeToString(h.Sum(nil)[:16])
}

// View is a request as shown (R22.1, R22.2): the row, the node its
// approval takes as recorded now (nil for a new node, or when that node is
// gone), and the other open requests with the same hardware key.
type View struct {
	store.JoinRequest
	Node       *store.Node
	SameClaims []string
}

// MaxSameClaims bounds how many requests with the same claims a view
// names.
const MaxSameClaims = 10

// view reads what a request is shown with.
func view(ctx context.Context, tx *store.Tx, r store.JoinRequest) (View, error) {
	v := View{JoinRequest: r}
	if r.EffectNodeID != "" {
		switch n, err := tx.GetNode(ctx, r.EffectNodeID); {
		case err == nil && n.TenantID == r.TenantID:
			v.Node = &n
		case err != nil && !errors.Is(err, store.ErrNotFound):
			return View{}, err
		}
	}
	if len(r.HardwareKey) > 0 && (r.State == store.JoinRequestPending || r.State == store.JoinRequestApproved) {
		// Only the pool's: a reader of this pool's requests may not read
		// another pool's.
		same, err := tx.OpenJoinRequestsByHardwareKey(ctx, r.TenantID, r.PoolID, r.HardwareKey, MaxSameClaims+1)
		if err != nil {
			return View{}, err
		}
		for _, o := range same {
			if o.ID != r.ID && o.MachineKey != r.MachineKey && len(v.SameClaims) < MaxSameClaims {
				v.SameClaims = append(v.SameClaims, o.ID)
			}
		}
	}
	return v, nil
}

// Publish publishes a join request event of type typ (EventCreated, …)
// inside tx, with Published(r) as its data and the request as its subject.
func Publish(ctx context.Context, tx *store.Tx, hub *events.Hub, typ string, r store.JoinRequest) error {
	return events.Publish(ctx, tx, hub, events.Event{TenantID: r.TenantID, Type: typ, Subject: r.ID, Data: Published(r)})
}

// Service lists and decides join requests.
type Service struct {
	db      *store.DB
	hub     *events.Hub
	clock   clock.Clock
	metrics *apimetrics.API
}

// Config lists the Service's dependencies.
type Config struct {
	DB  *store.DB
	Hub *events.Hub
	// Clock times decisions and tells expired approvals (default: the
	// wall clock); JoinService consumes approvals on the same clock.
	Clock clock.Clock
	// Metrics, when set, counts decisions.
	Metrics *apimetrics.API
}

// New returns a Service.
func New(cfg Config) *Service {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	return &Service{db: cfg.DB, hub: cfg.Hub, clock: cfg.Clock, metrics: cfg.Metrics}
}

// listStates turns the states asked for into the stored states to read and
// the shown states to keep. None is pending only; StateAll alone is every
// state.
func listStates(asked []string) (stored []string, keep map[string]bool, err error) {
	switch {
	case len(asked) == 0:
		asked = []string{store.JoinRequestPending}
	case len(asked) == 1 && asked[0] == StateAll:
		return nil, nil, nil
	case len(asked) > len(States):
		return nil, nil, errs.Invalid("state", "at most %d states", len(States))
	}
	keep = map[string]bool{}
	for _, s := range asked {
		switch s {
		case store.JoinRequestPending, store.JoinRequestApproved, store.JoinRequestRejected, store.JoinRequestConsumed, store.JoinRequestExpired:
		case StateAll:
			return nil, nil, errs.Invalid("state", "%q stands alone", StateAll)
		default:
			return nil, nil, errs.Invalid("state", "want %s, or %s alone", strings.Join(States, ", "), StateAll)
		}
		keep[s] = true
	}
	for _, s := range States {
		// An approval that ran out may not be stored as expired yet, and
		// a stored approval may show as expired.
		if keep[s] || s == store.JoinRequestApproved && keep[store.JoinRequestExpired] {
			stored = append(stored, s)
		}
	}
	return stored, keep, nil
}

// List lists a pool's requests in id order after `after`, up to limit, in
// the states asked for (none: pending only; StateAll: every state), each
// with its shown State (R10.2).
func (s *Service) List(ctx context.Context, p authz.Principal, tenantID, poolID string, states []string, after string, limit int) ([]View, error) {
	if err := p.ActFor(tenantID); err != nil {
		return nil, err
	}
	stored, keep, err := listStates(states)
	if err != nil {
		return nil, err
	}
	var out []View
	start := after
	err = s.db.ReadTx(ctx, func(tx *store.Tx) error {
		// A retried transaction reads the page again from its start.
		out, after = nil, start
		pool, err := tenancy.PoolFor(ctx, tx, p, tenantID, poolID, authz.JoinRequestsRead)
		if err != nil {
			return err
		}
		now := s.clock.Now()
		// Approved rows shown as expired (or the reverse) are skipped, so
		// a page is filled from as many reads as it takes.
		for len(out) < limit {
			rows, err := tx.ListJoinRequests(ctx, tenantID, pool.ID, stored, after, limit)
			if err != nil {
				return err
			}
			for _, r := range rows {
				after = r.ID
				if r.State = State(r, now); keep == nil || keep[r.State] {
					v, err := view(ctx, tx, r)
					if err != nil {
						return err
					}
					if out = append(out, v); len(out) == limit {
						return nil
					}
				}
			}
			if len(rows) < limit {
				return nil
			}
		}
		return nil
	})
	return out, err
}

// Get reads one request of the pool, as List shows it (R22.1). Another
// pool's or tenant's is NOT_FOUND.
func (s *Service) Get(ctx context.Context, p authz.Principal, tenantID, poolID, requestID string) (View, error) {
	if err := p.ActFor(tenantID); err != nil {
		return View{}, err
	}
	if !ids.Valid(ids.JoinRequest, requestID) {
		return View{}, errs.Invalid("requestId", "want a join request id jreq_…")
	}
	var out View
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		pool, err := tenancy.PoolFor(ctx, tx, p, tenantID, poolID, authz.JoinRequestsRead)
		if err != nil {
			return err
		}
		r, err := poolRequest(ctx, tx, tenantID, pool.ID, requestID)
		if err != nil {
			return err
		}
		r.State = State(r, s.clock.Now())
		out, err = view(ctx, tx, r)
		return err
	})
	return out, err
}

// poolRequest reads a request of the tenant's pool; NOT_FOUND otherwise.
func poolRequest(ctx context.Context, tx *store.Tx, tenantID, poolID, requestID string) (store.JoinRequest, error) {
	r, err := tx.GetJoinRequest(ctx, requestID)
	if errors.Is(err, store.ErrNotFound) || err == nil && (r.TenantID != tenantID || r.PoolID != poolID) {
		return store.JoinRequest{}, errs.New(errs.NotFound, "join request %s not found in pool %s", requestID, poolID)
	}
	return r, err
}

// checkReason checks a decision's reason: required, one line, bounded.
func checkReason(reason string) (string, error) {
	reason = strings.TrimSpace(reason)
	if reason == "" {
		return "", errs.Invalid("reason", "required: say why (a ticket, an intake)")
	}
	if len(reason) > MaxReason {
		return "", errs.Invalid("reason", "at most %d bytes", MaxReason)
	}
	for _, c := range reason {
		if !unicode.IsPrint(c) {
			return "", errs.Invalid("reason", "printable characters on one line only")
		}
	}
	return reason, nil
}

// Approval is what an approver saw and acknowledged (R22.2).
type Approval struct {
	// TTL is how long the approval admits the retry: whole seconds, 60 to
	// 86400.
	TTL    time.Duration
	Reason string
	// Version is the request's Version as shown; "" binds nothing, which
	// only a request that takes no node accepts.
	Version string
	// AcknowledgeReclaimNodeID must name the node a reclaim takes over.
	AcknowledgeReclaimNodeID string
}

// Approve approves a pending request of the pool (R10.3): the retry with
// its CSR is admitted once within a.TTL. A request that is not pending is
// INVALID_STATE; another pool's or tenant's is NOT_FOUND. A reclaim needs
// a.AcknowledgeReclaimNodeID naming its node and a.Version (else
// INVALID_STATE); a version other than the request's is CONFLICT (R22.2).
// It publishes security.join-request.approved and writes an audit row
// with the acknowledgement.
func (s *Service) Approve(ctx context.Context, p authz.Principal, tenantID, poolID, requestID string, a Approval) (store.JoinRequest, error) {
	if a.TTL < MinTTL || a.TTL > MaxTTL || a.TTL%time.Second != 0 {
		return store.JoinRequest{}, errs.Invalid("ttlSeconds", "must be whole seconds from 60 to 86400")
	}
	if a.AcknowledgeReclaimNodeID != "" && !ids.Valid(ids.Node, a.AcknowledgeReclaimNodeID) {
		return store.JoinRequest{}, errs.Invalid("acknowledgeReclaimNodeId", "want a node id node_…")
	}
	return s.decide(ctx, p, tenantID, poolID, requestID, store.JoinRequestApproved, a)
}

// checkApproval checks an approval against the request it approves
// (R22.2): the version shown, then the acknowledgement of a reclaim.
func checkApproval(r store.JoinRequest, a Approval) error {
	if a.Version != "" && a.Version != Version(r) {
		return errs.New(errs.Conflict, "join request %s changed since it was listed (a newer attempt refreshed it); list it again and review it", r.ID)
	}
	reclaim := r.Effect == store.JoinEffectReclaim
	switch {
	case reclaim && a.AcknowledgeReclaimNodeID == "":
		return errs.New(errs.InvalidState, "join request %s reclaims node %s: approving it makes this machine that node and revokes its certificates; acknowledge it by naming the node", r.ID, r.EffectNodeID)
	case reclaim && a.AcknowledgeReclaimNodeID != r.EffectNodeID:
		return errs.New(errs.InvalidState, "join request %s reclaims node %s, not %s", r.ID, r.EffectNodeID, a.AcknowledgeReclaimNodeID)
	case !reclaim && a.AcknowledgeReclaimNodeID != "":
		return errs.New(errs.InvalidState, "join request %s reclaims no node", r.ID)
	case reclaim && a.Version == "":
		return errs.New(errs.InvalidState, "join request %s reclaims node %s: an approval must name the version it reviewed", r.ID, r.EffectNodeID)
	}
	return nil
}

// Reject rejects a pending request of the pool (R10.3): a retry with its
// CSR fails. A request that is not pending is INVALID_STATE; another
// pool's or tenant's is NOT_FOUND. It publishes
// security.join-request.rejected and writes an audit row.
func (s *Service) Reject(ctx context.Context, p authz.Principal, tenantID, poolID, requestID, reason string) (store.JoinRequest, error) {
	return s.decide(ctx, p, tenantID, poolID, requestID, store.JoinRequestRejected, Approval{Reason: reason})
}

func (s *Service) decide(ctx context.Context, p authz.Principal, tenantID, poolID, requestID, state string, a Approval) (store.JoinRequest, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.JoinRequest{}, err
	}
	if !ids.Valid(ids.JoinRequest, requestID) {
		return store.JoinRequest{}, errs.Invalid("requestId", "want a join request id jreq_…")
	}
	reason, err := checkReason(a.Reason)
	if err != nil {
		return store.JoinRequest{}, err
	}
	action, typ, audit := authz.JoinRequestsApprove, EventApproved, "join-request.approved"
	if state == store.JoinRequestRejected {
		action, typ, audit = authz.JoinRequestsReject, EventRejected, "join-request.rejected"
	}
	var out store.JoinRequest
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		pool, err := tenancy.PoolFor(ctx, tx, p, tenantID, poolID, action)
		if err != nil {
			return err
		}
		r, err := poolRequest(ctx, tx, tenantID, pool.ID, requestID)
		if err != nil {
			return err
		}
		now := s.clock.Now()
		if shown := State(r, now); shown != store.JoinRequestPending {
			return errs.New(errs.InvalidState, "join request %s is %s: only a pending request is decided", requestID, shown)
		}
		var until *time.Time
		if state == store.JoinRequestApproved {
			if err := checkApproval(r, a); err != nil {
				return err
			}
			u := now.Add(a.TTL)
			until = &u
		}
		out, err = tx.DecideJoinRequest(ctx, requestID, state, p.ID, reason, a.AcknowledgeReclaimNodeID, now, until)
		if errors.Is(err, store.ErrNotFound) {
			return errs.New(errs.InvalidState, "join request %s was decided or refreshed meanwhile; list it again", requestID)
		}
		if err != nil {
			return err
		}
		if err := Publish(ctx, tx, s.hub, typ, out); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: audit, Resource: Resource(out.ID), Data: Published(out)})
	})
	if err == nil {
		s.metrics.Decided(state)
	}
	return out, err
}
