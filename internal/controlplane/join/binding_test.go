package join_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R4.2: the seal covers the whole request, so the gateway that relays it can
// change nothing: any field changed after sealing, or a seal moved from
// another request, is refused (seal-request-mismatch) before the token is
// looked at; a seal older than 10 minutes or dated more than 5 minutes
// ahead of JoinService's clock is refused too. None of it spends a use, and
// the reason goes to the root tenant: the token's secret never verified.
func TestRelayCannotChangeTheRequestR4_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		// Whole seconds, as iat is: the bounds below are exact.
		clk := clock.NewFake(time.Now().Truncate(time.Second))
		svc := ownService(t, e, clk, events.NewLimiter(clk, 1000, time.Minute), 0)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, MaxUses: 5})
		n := 0
		request := func(t *testing.T) *agentv1.JoinRequest {
			n++
			return jointest.NewMachine(t, jointest.Claims(5000+n)).Request(t, e.Bundle, tok.Token, "")
		}
		sealAt := func(t *testing.T, req *agentv1.JoinRequest, iat time.Time) {
			req.SealedToken = jointest.SealAt(t, e.Bundle, tok.Token, req, iat)
		}
		tests := []struct {
			name   string
			edit   func(t *testing.T, req *agentv1.JoinRequest)
			reason string
		}{
			{"hostname changed", func(t *testing.T, r *agentv1.JoinRequest) { r.Claims.Hostname = "relay" }, "seal-request-mismatch"},
			{"MAC added", func(t *testing.T, r *agentv1.JoinRequest) { r.Claims.Macs = append(r.Claims.Macs, "00:1b:21:ff:ff:ff") }, "seal-request-mismatch"},
			{"serial dropped", func(t *testing.T, r *agentv1.JoinRequest) { r.Claims.ProductSerial = "" }, "seal-request-mismatch"},
			{"role changed", func(t *testing.T, r *agentv1.JoinRequest) { r.Role = pki.RoleSite }, "seal-request-mismatch"},
			{"node id added", func(t *testing.T, r *agentv1.JoinRequest) { r.NodeId = "node_01k5w7c2v9m3y8q4r6t2x0z1a3" }, "seal-request-mismatch"},
			{"evidence added", func(t *testing.T, r *agentv1.JoinRequest) { r.Evidence = []byte("x") }, "seal-request-mismatch"},
			{"key attestation added", func(t *testing.T, r *agentv1.JoinRequest) { r.KeyAttestation = []byte("x") }, "seal-request-mismatch"},
			{"protocol changed", func(t *testing.T, r *agentv1.JoinRequest) { r.Protocol = 2 }, "seal-request-mismatch"},
			{"seal of another request of the same key", func(t *testing.T, r *agentv1.JoinRequest) {
				other := proto.Clone(r).(*agentv1.JoinRequest)
				other.Claims.Hostname = "other"
				sealAt(t, other, clk.Now())
				r.SealedToken = other.SealedToken
			}, "seal-request-mismatch"},
			{"seal 10 min and 1 s old", func(t *testing.T, r *agentv1.JoinRequest) {
				sealAt(t, r, clk.Now().Add(-10*time.Minute-time.Second))
			}, "seal-expired"},
			{"seal 5 min and 1 s ahead", func(t *testing.T, r *agentv1.JoinRequest) {
				sealAt(t, r, clk.Now().Add(5*time.Minute+time.Second))
			}, "seal-iat-future"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				req := request(t)
				sealAt(t, req, clk.Now())
				tt.edit(t, req)
				f.refusedOnce(t, f.root, reason(tt.reason), func() error {
					_, err := svc.Join(context.Background(), req, join.Peer{})
					return err
				})
			})
		}
		if got := f.usesLeft(t, tok.Id); got != 5 {
			t.Fatalf("usesLeft %d after refused joins, want 5", got)
		}
		// The bounds are inclusive: a seal exactly 10 minutes old joins.
		req := request(t)
		sealAt(t, req, clk.Now().Add(-10*time.Minute))
		if _, err := svc.Join(context.Background(), req, join.Peer{}); err != nil {
			t.Fatalf("a seal exactly 10 minutes old: %v", err)
		}
	})
}
