package enroll

import (
	"context"
	"errors"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// Waits of a join deferred to a join request (R10.1): the control plane
// says how long; bcd keeps to these bounds whatever it says.
const (
	MinDeferralWait = time.Second
	MaxDeferralWait = 5 * time.Minute
	// deferralNote is how often a waiting join says it is still waiting.
	deferralNote = 5 * time.Minute
)

// bootEvidence is the discovery attestor's evidence for b (nil without a
// boot): its MAC and address checked and in their canonical form.
func bootEvidence(b *Boot) ([]byte, error) {
	if b == nil {
		return nil, nil
	}
	c, err := hwid.Boot{MAC: b.MAC, IP: b.IP, LeaseEpoch: b.LeaseEpoch, WorkflowID: b.WorkflowID}.Check()
	if err != nil {
		var e *errs.E
		if errors.As(err, &e) {
			// Name the flag, not the field.
			flag := map[string]string{"mac": "--boot-mac", "ip": "--boot-ip", "leaseEpoch": "--boot-lease-epoch", "workflowId": "--workflow-id"}[e.Field]
			return nil, errs.Invalid(flag, "%s", e.Message)
		}
		return nil, err
	}
	return proto.MarshalOptions{Deterministic: true}.Marshal(&agentv1.DiscoveryEvidence{
		Mac: c.MAC, Ip: c.IP, BootLeaseEpoch: c.LeaseEpoch, WorkflowId: c.WorkflowID,
	})
}

// sendUntilDecided sends the join request and checks the answer (R4.6).
// While the answer is a signed deferral (R10.1) it waits as told and sends
// the very same request again (same key and CSR: the one an approval
// admits), until the answer is a certificate, a refusal (a rejected
// request, an approval that ran out or was used), or ctx ends. join.pending
// keeps the request meanwhile, so a bcd join after a restart waits on the
// same join request.
func (j *Joiner) sendUntilDecided(ctx context.Context, cfg *bcdconfig.Config, req *agentv1.JoinRequest, reseal func(*agentv1.JoinRequest) error, want expectation) (*agentv1.JoinResponseBody, error) {
	return j.untilDecided(ctx, want, "bcd join again with the same token", func() (*agentv1.JoinResponse, bool, error) {
		return j.send(ctx, cfg, req, reseal)
	})
}

// untilDecided is sendUntilDecided for any attempt: attempt makes one
// whole attempt (for the TPM, both legs, so each retry gets a fresh
// challenge) and again says how to pick the join up after a failure.
func (j *Joiner) untilDecided(ctx context.Context, want expectation, again string, attempt func() (*agentv1.JoinResponse, bool, error)) (*agentv1.JoinResponseBody, error) {
	var waiting string // the join request waited on
	var since, noted time.Time
	defer func() { j.waiting = false }()
	for {
		res, answered, err := attempt()
		if err != nil {
			err = j.sendFailed(err, answered, again)
			if waiting != "" && errs.CodeOf(err) == errs.AccessDenied {
				return nil, errs.New(errs.AccessDenied,
					"Join refused after waiting on join request %s: an operator rejected it, or its approval ran out or was already used. Ask the operator (better-compute join-requests list --state all); bcd join again makes a new request", waiting)
			}
			return nil, err
		}
		body, err := verifyResponse(res, want)
		if err != nil {
			return nil, err
		}
		d := body.GetDeferral()
		if d == nil {
			return body, nil
		}
		now := j.clock.Now()
		switch {
		case waiting != d.GetRequestId():
			waiting, since, noted = d.GetRequestId(), now, now
			j.progress("join request %s is waiting for approval (an operator runs: better-compute join-requests approve %s --tenant … --pool … --ttl 900 --reason …); asking again until it is decided, Ctrl-C to stop", waiting, waiting)
		case now.Sub(noted) >= deferralNote:
			noted = now
			j.progress("join request %s still waiting for approval (%s)", waiting, now.Sub(since).Round(time.Second))
		}
		j.waiting = true
		wait := min(max(time.Duration(d.GetRetryAfterSeconds())*time.Second, MinDeferralWait), MaxDeferralWait)
		if err := j.sleep(ctx, wait); err != nil {
			return nil, errs.New(errs.Unavailable, "stopped while join request %s waits for approval; %s keeps waiting on it", waiting, again)
		}
	}
}
