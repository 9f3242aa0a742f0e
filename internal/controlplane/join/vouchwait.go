package join

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
)

// DefaultVouchWait is how long a discovery join waits for its vouch: a
// site agent reports a boot within seconds of its boot module recording
// it, and a ramdisk can ask sooner (`bcd site vouch` then a join, back to
// back: the agent's first report follows its session by its 2-second
// booted-file check). It stays well under the gateway's request timeout;
// with several API replicas the gateway's hedge may ask a second one
// meanwhile, which waits the same and answers the same.
const DefaultVouchWait = 8 * time.Second

// vouchPoll is how often a waiting discovery join looks again.
const vouchPoll = 250 * time.Millisecond

// admitVouched is admit for the discovery attestor (R10.4): a join whose
// vouch has not arrived yet (vouch-missing) is tried again until it has or
// VouchWait passed, outside any transaction, so a ramdisk that asks before
// its site agent reported its boot is admitted rather than refused. It
// returns what admit returns; its wait is not an admit phase's time.
//
// SECURITY: every refused discovery join is answered only once VouchWait
// passed, whatever its reason, so the time a refusal takes tells the
// caller nothing a refusal's words do not (whether some site vouched for a
// MAC, for one). The refusal is recorded once, with the last reason.
func (s *Service) admitVouched(ctx context.Context, att attest.Attestor, in *attest.Input, pub *ecdsa.PublicKey, req *agentv1.JoinRequest, peer Peer) (*agentv1.JoinResponse, string, error) {
	deadline := s.clock.Now().Add(s.cfg.VouchWait)
	for {
		res, outcome, err := s.admit(ctx, att, in, pub, req, peer)
		var r *nodeident.Refusal
		if !errors.As(err, &r) {
			return res, outcome, err
		}
		left := deadline.Sub(s.clock.Now())
		if left <= 0 {
			return nil, "", err
		}
		wait := left
		if r.Reason == discovery.ReasonVouchMissing && wait > vouchPoll {
			wait = vouchPoll
		}
		t := s.clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, "", err
		case <-t.C():
		}
		if r.Reason != discovery.ReasonVouchMissing {
			return nil, "", err
		}
	}
}
