package join_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"strings"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R4.7: refusal events are limited to 60 per attestor and reason per
// minute; the next one after the window carries the number dropped.
func TestRefusalRateLimitR4_7(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		fc := clock.NewFake(time.Now())
		svc := ownService(t, e, fc, events.NewLimiter(fc, 60, time.Minute), 0)
		ctx := context.Background()
		bad := jointest.NewMachine(t, jointest.Claims(1)).Request(t, e.Bundle, "", "")
		bad.SealedToken = "a.b.c.d.e"
		noToken := jointest.NewMachine(t, jointest.Claims(2)).Request(t, e.Bundle, "", "")
		count := func(r string) (n int, last jointest.Refusal) {
			for _, x := range jointest.Refusals(t, e.DB, f.root) {
				if x.Reason == r {
					n, last = n+1, x
				}
			}
			return n, last
		}
		for range 65 {
			_, err := svc.Join(ctx, bad, join.Peer{})
			jointest.WantRefused(t, err)
			fc.Advance(100 * time.Millisecond)
		}
		if n, _ := count(reason("seal-malformed")); n != 60 {
			t.Fatalf("%d events for 65 refusals in a minute, want 60", n)
		}
		// Another reason has its own budget.
		_, err := svc.Join(ctx, noToken, join.Peer{})
		jointest.WantRefused(t, err)
		if n, last := count(reason("token-missing")); n != 1 || last.Suppressed != 0 {
			t.Fatalf("token-missing: %d events, last %+v", n, last)
		}
		fc.Advance(time.Minute)
		_, err = svc.Join(ctx, bad, join.Peer{})
		jointest.WantRefused(t, err)
		n, last := count(reason("seal-malformed"))
		if n != 61 || last.Suppressed != 5 {
			t.Fatalf("after the window: %d events, last suppressed %d; want 61 and 5", n, last.Suppressed)
		}
		_, err = svc.Join(ctx, bad, join.Peer{})
		jointest.WantRefused(t, err)
		if _, last := count(reason("seal-malformed")); last.Suppressed != 0 {
			t.Errorf("suppressed %d on the next event, want 0", last.Suppressed)
		}
	})
}

// R4.4, R4.8: 200 machines racing for a token of 50 uses: exactly 50 join;
// the rest are refused and spend nothing.
func TestConcurrentJoinsR4_8(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 50})
		const n = 200
		reqs := make([]*agentv1.JoinRequest, n)
		for i := range reqs {
			reqs[i] = jointest.NewMachine(t, jointest.Claims(10000+i)).Request(t, e.Bundle, tok.Token, "")
		}
		errsOut := make([]error, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range reqs {
			wg.Go(func() {
				<-start
				_, errsOut[i] = f.svc.Join(context.Background(), reqs[i], join.Peer{})
			})
		}
		close(start)
		wg.Wait()
		ok := 0
		for _, err := range errsOut {
			if err == nil {
				ok++
				continue
			}
			jointest.WantRefused(t, err)
		}
		if ok != 50 {
			t.Errorf("%d joins succeeded, want 50", ok)
		}
		if got := len(f.nodes(t, f.root)); got != 50 {
			t.Errorf("%d nodes, want 50", got)
		}
		if got := f.usesLeft(t, tok.Id); got != 0 {
			t.Errorf("usesLeft %d, want 0", got)
		}
		// 150 used-up refusals within a minute: the limiter keeps 60.
		if got := len(jointest.Refusals(t, e.DB, f.root)); got != 60 {
			t.Errorf("%d refusal events, want 60 (rate limit)", got)
		}
	})
}

// R4.8: two joins of one machine racing end with one node; the loser gets
// CONFLICT "This machine joined concurrently; retry", or, when it ran after
// the winner committed, a reclaim refusal. Which one is timing-dependent:
// the test reports what it saw.
func TestRacingJoinsOfOneMachineR4_8(t *testing.T) {
	for _, mode := range []string{"one token of 2 uses", "two tokens"} {
		t.Run(mode, func(t *testing.T) {
			apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
				f := newFixture(t, e)
				const rounds = 20
				var conflicts, reclaims int
				for r := range rounds {
					claims := jointest.Claims(20000 + r)
					var toks [2]string
					if mode == "two tokens" {
						toks[0], toks[1] = f.token(t, nil).Token, f.token(t, nil).Token
					} else {
						tk := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2}).Token
						toks[0], toks[1] = tk, tk
					}
					var reqs [2]*agentv1.JoinRequest
					for i := range reqs {
						reqs[i] = jointest.NewMachine(t, claims).Request(t, e.Bundle, toks[i], "")
					}
					var outs [2]error
					var wg sync.WaitGroup
					start := make(chan struct{})
					for i := range reqs {
						wg.Go(func() {
							<-start
							_, outs[i] = f.svc.Join(context.Background(), reqs[i], join.Peer{})
						})
					}
					close(start)
					wg.Wait()
					won := 0
					for _, err := range outs {
						switch {
						case err == nil:
							won++
						case errs.CodeOf(err) == errs.Conflict:
							jointest.WantError(t, err, errs.Conflict, jointest.RaceMessage)
							conflicts++
						default:
							jointest.WantRefused(t, err)
							reclaims++
						}
					}
					if won != 1 {
						t.Fatalf("round %d: %d joins won (%v)", r, won, outs)
					}
				}
				if got := len(f.nodes(t, f.root)); got != rounds {
					t.Errorf("%d nodes after %d rounds, want one per machine", got, rounds)
				}
				var refusedReclaim int
				for _, x := range jointest.Refusals(t, e.DB, f.root) {
					if x.Reason != reason("reclaim") {
						t.Errorf("unexpected refusal %+v", x)
					}
					refusedReclaim++
				}
				if refusedReclaim != reclaims {
					t.Errorf("%d reclaim refusal events for %d refused losers", refusedReclaim, reclaims)
				}
				t.Logf("%s, %s: %d rounds: %d CONFLICT, %d reclaim refusals", e.DB.Dialect(), mode, rounds, conflicts, reclaims)
			})
		})
	}
}

// Bad input is refused before any database work, with a specific reason.
func TestBadInputRefused(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 100})
		acmeTok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, MaxUses: 100})
		rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
		if err != nil {
			t.Fatal(err)
		}
		req := func(mod func(r *agentv1.JoinRequest, m *jointest.Machine)) func(t *testing.T) *agentv1.JoinRequest {
			return func(t *testing.T) *agentv1.JoinRequest {
				m := jointest.NewMachine(t, jointest.Claims(30000))
				r := m.Request(t, e.Bundle, tok.Token, "")
				mod(r, m)
				return r
			}
		}
		reseal := func(r *agentv1.JoinRequest) { r.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, r) }
		for _, tc := range []struct {
			name, reason string
			acme         bool
			req          func(t *testing.T) *agentv1.JoinRequest
		}{
			{"CSR with a bad signature", "csr-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) {
				r.Csr = append([]byte(nil), r.Csr...)
				r.Csr[len(r.Csr)-2] ^= 0xff
				reseal(r)
			})},
			{"RSA CSR", "csr-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Csr = jointest.CSR(t, rsaKey); reseal(r) })},
			{"not a CSR", "csr-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Csr = []byte("hello"); reseal(r) })},
			{"no CSR", "csr-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Csr = nil })},
			{"duplicate MACs", "claims-duplicate-mac", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) {
				r.Claims.Macs = []string{"00:1b:21:aa:bb:cc", "00-1B-21-AA-BB-CC"}
			})},
			{"invalid UTF-8", "claims-invalid-utf8", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Claims.Hostname = "host\xff" })},
			{"control character", "claims-control-char", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Claims.ProductSerial = "SN\x1b[2J" })},
			{"bad MAC", "claims-bad-mac", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Claims.Macs = []string{"00:1b:21:aa:bb"} })},
			{"bad product UUID", "claims-bad-uuid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Claims.ProductUuid = "not-a-uuid" })},
			{"malformed node id", "node-id-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.NodeId = "node_../../x" })},
			{"node id of no node of this machine", "node-id-mismatch", true, req(func(r *agentv1.JoinRequest, m *jointest.Machine) {
				r.NodeId = ids.New(ids.Node, time.Now())
				r.SealedToken = jointest.Seal(t, e.Bundle, acmeTok.Token, r)
			})},
			{"role node-tenant requested", "role-invalid", false, req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Role = pki.RoleNodeTenant })},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r := tc.req(t)
				tenant := f.root
				if tc.acme {
					tenant = f.acme
				}
				f.refusedOnce(t, tenant, reason(tc.reason), func() error { _, err := f.svc.Join(context.Background(), r, join.Peer{}); return err })
			})
		}
		// R4.7: the caller's own text never reaches the event stream: an
		// invalid role is recorded as "invalid".
		r := req(func(r *agentv1.JoinRequest, _ *jointest.Machine) { r.Role = strings.Repeat("x", 4000) })(t)
		if _, err := f.svc.Join(context.Background(), r, join.Peer{}); !errs.Is(err, errs.AccessDenied) {
			t.Fatalf("long role: %v", err)
		}
		refs := jointest.Refusals(t, e.DB, f.root)
		if last := refs[len(refs)-1]; last.Reason != "join-token:role-invalid" || last.Role != "invalid" {
			t.Errorf("refusal recorded %+v", last)
		}
		if got := f.usesLeft(t, tok.Id); got != 100 {
			t.Errorf("usesLeft %d, want 100", got)
		}
		if got := f.usesLeft(t, acmeTok.Id); got != 100 {
			t.Errorf("acme usesLeft %d, want 100", got)
		}
	})
}
