package join

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/joinreq"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// DefaultRetryAfter is how long a deferred daemon is told to wait before
// it sends its request again.
const DefaultRetryAfter = 5 * time.Second

// approved is what the join-request check decided for a deferred join.
type approved struct {
	// consume is the approved request this join spends, once its node is
	// written; "" when the join waits.
	consume string
	// waiting is the request the join waits on; nil when it is admitted.
	waiting *store.JoinRequest
}

// approval is the join-request check of a join its attestor deferred
// (R10.1–R10.3), inside the admission transaction:
//   - the machine's open request approved for this very CSR, in time:
//     the join is admitted and consumes it (once: ConsumeJoinRequest);
//   - an approval that ran out is marked expired, and the join waits
//     again on a new request;
//   - a CSR whose request was rejected, or already admitted a join, is
//     refused;
//   - otherwise the machine's one open request is recorded, or refreshed
//     with this CSR, and the join waits: nothing is issued or spent.
func (s *Service) approval(ctx context.Context, tx *store.Tx, adm *attest.Admission, attestor string, in *attest.Input, claimsJSON []byte, siteID string, d decision, source string) (approved, error) {
	a, tenant, now := adm.Approval, adm.TenantID, s.clock.Now()
	open, err := tx.OpenJoinRequest(ctx, tenant, a.MachineKey)
	found := err == nil
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return approved{}, err
	}
	// R22.2: what approving does may have changed since the request was
	// recorded (a node with these claims appeared, or went): the request
	// is refreshed to show it, and an approval given for the old effect is
	// void.
	effectChanged := found && effectDiffers(open, d)
	if found && !effectChanged && bytes.Equal(open.CSRSHA256, in.CSRSHA256) {
		got, done, err := s.sameCSR(ctx, tx, open, d, now)
		if done || err != nil {
			return got, err
		}
		found = false
	}
	// R10.3: a rejected CSR fails; a consumed one admitted its one join
	// (the very same request again gets its stored answer instead).
	prior, err := tx.JoinRequestByCSR(ctx, tenant, in.CSRSHA256)
	switch {
	case err == nil && prior.State == store.JoinRequestRejected:
		return approved{}, attest.Refuse("join-request-rejected", tenant)
	case err == nil && prior.State == store.JoinRequestConsumed:
		return approved{}, attest.Refuse("join-request-consumed", tenant)
	case err != nil && !errors.Is(err, store.ErrNotFound):
		return approved{}, err
	}
	// R15.4: what an unauthenticated caller writes is bounded. A machine
	// refreshes its request at most once per RefreshInterval (each refresh
	// is an event and an audit row); a new request needs room in its pool
	// and from its source.
	if found && !effectChanged {
		recent, err := tx.JoinRequestRefreshedWithin(ctx, open.ID, s.cfg.Limits.RefreshInterval)
		if err != nil {
			return approved{}, err
		}
		if recent {
			return approved{waiting: &open}, nil
		}
	} else if err := s.roomForRequest(ctx, tx, tenant, adm.PoolID, source); err != nil {
		return approved{}, err
	}
	r := store.JoinRequest{
		TenantID: tenant, PoolID: adm.PoolID, SiteID: siteID, Attestor: attestor, Role: d.Role, MachineKey: a.MachineKey,
		Claims: claimsJSON, EKHash: a.EKHash, MAC: a.MAC, IP: a.IP, WorkflowID: a.WorkflowID, VouchedBy: a.VouchedBy,
		BootLeaseEpoch: a.BootLeaseEpoch, CSRSHA256: in.CSRSHA256, Source: source,
		EKCert: a.EKCert, EKCertSubject: a.EKCertSubject, EKCertIssuer: a.EKCertIssuer, AKName: a.AKName,
	}
	r.Effect, r.EffectNodeID = effectOf(d)
	if in.Key.Trusted {
		r.HardwareKey = in.Key.Hash[:]
	}
	event := joinreq.EventCreated
	data := map[string]any{}
	if found {
		// R10.2: a newer attempt refreshes the machine's one request with
		// its new CSR; an approval given for the older CSR is void.
		r.ID = open.ID
		if r, err = tx.RefreshJoinRequest(ctx, r); errors.Is(err, store.ErrNotFound) {
			return approved{}, errRace
		} else if err != nil {
			return approved{}, err
		}
		event = joinreq.EventRefreshed
		data["approvalVoided"] = open.State == store.JoinRequestApproved
		data["effectChanged"] = effectChanged
	} else {
		r.ID = ids.New(ids.JoinRequest, now)
		if r, err = tx.InsertJoinRequest(ctx, r); err != nil {
			if store.IsUniqueViolation(err) {
				return approved{}, errRace
			}
			return approved{}, fmt.Errorf("record join request: %w", err)
		}
	}
	for k, v := range joinreq.Published(r) {
		data[k] = v
	}
	if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: tenant, Type: event, Subject: r.ID, Data: data}); err != nil {
		return approved{}, err
	}
	if err := events.Audit(ctx, tx, events.Entry{TenantID: tenant, Actor: "system", Action: strings.TrimPrefix(event, "security."), Resource: joinreq.Resource(r.ID), Data: data}); err != nil {
		return approved{}, err
	}
	return approved{waiting: &r}, nil
}

// sameCSR is the join-request check of a retry with the CSR its open
// request holds, and the same effect: an approval in time admits it (done,
// with the request to consume), a pending request keeps it waiting (done),
// and an approval that ran out is stored as expired (not done: the retry
// waits on a new request).
func (s *Service) sameCSR(ctx context.Context, tx *store.Tx, open store.JoinRequest, d decision, now time.Time) (approved, bool, error) {
	switch {
	case open.State == store.JoinRequestApproved && open.ApprovedUntil != nil && now.Before(*open.ApprovedUntil):
		// R22.2: a join that takes a node needs an approval that
		// acknowledged that very node (the operator API never approves a
		// reclaim otherwise).
		if d.Outcome == joinReclaim && open.AcknowledgedNodeID != d.NodeID {
			return approved{}, true, attest.Refuse(ReasonReclaimUnacknowledged, open.TenantID)
		}
		return approved{consume: open.ID}, true, nil
	case open.State == store.JoinRequestApproved:
		// R10.3: an approval admits one join until it runs out.
		if err := tx.ExpireJoinRequest(ctx, open.ID, now); err != nil {
			return approved{}, true, err
		}
		tx.AfterCommit(func() { s.cfg.Metrics.Decided(telemetry.DecisionExpired) })
		return approved{}, false, nil
	default:
		// Still pending: the daemon asks again later.
		return approved{waiting: &open}, true, nil
	}
}

// effectDiffers says whether the effect an open request records is not
// what approving it does now (R22.2). A request recorded before effects
// were (no effect) is taken as a new node's.
func effectDiffers(open store.JoinRequest, d decision) bool {
	eff, node := effectOf(d)
	was := open.Effect
	if was == "" {
		was = store.JoinEffectNew
	}
	return was != eff || open.EffectNodeID != node
}

// ReasonReclaimUnacknowledged refuses a join whose approval did not
// acknowledge the node it takes (R22.2).
const ReasonReclaimUnacknowledged = "join-request-reclaim-unacknowledged"

// effectOf is what approving a deferred join with decision d does (R22.2):
// the node it takes, if any.
func effectOf(d decision) (effect, nodeID string) {
	switch d.Outcome {
	case joinReclaim, joinRejoin:
		return store.JoinEffectReclaim, d.NodeID
	case joinBind:
		return store.JoinEffectBind, d.NodeID
	default:
		return store.JoinEffectNew, ""
	}
}

// Join-request limits (R15.4).
const (
	DefaultMaxPendingPerPool   = 1000
	DefaultMaxPendingPerSource = 20
	DefaultRefreshInterval     = 30 * time.Second
)

// Refusal reasons of a join request the limits leave no room for.
const (
	ReasonPendingPoolLimit   = "join-requests-pool-limit"
	ReasonPendingSourceLimit = "join-requests-source-limit"
)

// RequestLimits bound the join requests that callers nobody has
// authenticated yet (an unknown EK, a vouched ramdisk) make the server
// write (R15.4).
type RequestLimits struct {
	// MaxPendingPerPool is the most pending requests a pool holds; past
	// it a new machine's deferred join is refused until a person decides.
	MaxPendingPerPool int
	// MaxPendingPerSource is the most pending requests, across pools, from
	// one source address (the peer the gateway saw).
	MaxPendingPerSource int
	// RefreshInterval is the least time between two refreshes of one
	// machine's request with a new CSR; a newer attempt within it waits on
	// the request as it is, writing nothing.
	RefreshInterval time.Duration
}

func (l RequestLimits) withDefaults() RequestLimits {
	if l.MaxPendingPerPool <= 0 {
		l.MaxPendingPerPool = DefaultMaxPendingPerPool
	}
	if l.MaxPendingPerSource <= 0 {
		l.MaxPendingPerSource = DefaultMaxPendingPerSource
	}
	if l.RefreshInterval <= 0 {
		l.RefreshInterval = DefaultRefreshInterval
	}
	return l
}

// roomForRequest refuses a new join request when its pool or its source
// holds as many pending requests as the limits allow. The refusal is
// recorded like any other, under the identity core's rate limit.
func (s *Service) roomForRequest(ctx context.Context, tx *store.Tx, tenant, poolID, source string) error {
	lim := s.cfg.Limits
	n, err := tx.PendingJoinRequests(ctx, tenant, poolID, "", lim.MaxPendingPerPool)
	if err != nil {
		return err
	}
	if n >= lim.MaxPendingPerPool {
		return attest.Refuse(ReasonPendingPoolLimit, tenant)
	}
	if source == "" {
		// No address to count by (not relayed by a gateway): the pool's
		// bound holds.
		return nil
	}
	if n, err = tx.PendingJoinRequests(ctx, "", "", source, lim.MaxPendingPerSource); err != nil {
		return err
	}
	if n >= lim.MaxPendingPerSource {
		return attest.Refuse(ReasonPendingSourceLimit, tenant)
	}
	return nil
}

// peerSource is the source a join request is counted under: the peer's
// address without its port.
func peerSource(addr string) string {
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}
