package join_test

import (
	"context"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R10.4: a ramdisk that asks before its site agent reported its boot (`bcd
// site vouch` and the join back to back) waits for the vouch instead of
// being refused; without one it is refused once the wait is over, recorded
// as discovery:vouch-missing, and a refusal for another reason takes as
// long, so its timing tells the caller nothing.
func TestDiscoveryWaitsForTheVouchR10_4(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		d := newDiscoIn(t, f, tenancy.ApprovalUnknownMachines)
		clk := clock.NewFake(time.Now().Truncate(time.Second))
		svc := ownServiceConfig(t, e, clk, events.NewLimiter(clk, 1000, time.Minute), 0, func(c *join.Config) {
			reg, err := attest.NewRegistry(jointoken.New(), discovery.New())
			if err != nil {
				t.Fatal(err)
			}
			c.Attestors, c.VouchWait = reg, 8*time.Second
		})
		type answer struct {
			res *agentv1.JoinResponse
			err error
		}
		// ask joins in the background and returns once it waits on the clock.
		ask := func(t *testing.T, claims int, b boot, peer string) <-chan answer {
			m := jointest.NewMachine(t, jointest.Claims(claims))
			req := d.request(t, m, d.ramdisk, withMAC(m, b), clk.Now())
			done := make(chan answer, 1)
			armed := clk.Armed()
			go func() {
				res, err := svc.Join(context.Background(), req, join.Peer{Addr: peer})
				done <- answer{res, err}
			}()
			waitUntil(t, "the join waits", func() bool { return clk.Armed() > armed })
			return done
		}
		t.Run("vouched while waiting", func(t *testing.T) {
			b := boot{ip: "10.0.9.1", epoch: 1}
			done := ask(t, 9101, b, "10.0.9.1:4000")
			d.vouch(t, d.site.Id, jointest.Claims(9101).Macs[0], b.ip, b.epoch)
			clk.Advance(time.Second)
			a := <-done
			if a.err != nil || !isDeferral(t, a.res) {
				t.Fatalf("join vouched for while it waited: %v, %v; want a deferral (the pool asks a person)", a.res, a.err)
			}
		})
		for _, tc := range []struct {
			name, ip, peer, reason string
			vouch                  bool
		}{
			{"never vouched", "10.0.9.2", "10.0.9.2:4000", "discovery:vouch-missing", false},
			{"from another address", "10.0.9.3", "192.0.2.7:4000", "discovery:vouch-peer", true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				claims := 9200 + len(tc.name)
				if tc.vouch {
					d.vouch(t, d.site.Id, jointest.Claims(claims).Macs[0], tc.ip, 1)
				}
				f.refusedOnce(t, d.root, tc.reason, func() error {
					start := clk.Now()
					done := ask(t, claims, boot{ip: tc.ip, epoch: 1}, tc.peer)
					for {
						select {
						case a := <-done:
							if waited := clk.Since(start); waited < 8*time.Second {
								t.Errorf("refused after %s, want the whole vouch wait (8s)", waited)
							}
							return a.err
						default:
							armed := clk.Armed()
							clk.Advance(250 * time.Millisecond)
							waitUntil(t, "the join waits again or answers", func() bool { return clk.Armed() >= armed || len(done) > 0 })
						}
					}
				})
			})
		}
	})
}

// withMAC is b on m's first MAC.
func withMAC(m *jointest.Machine, b boot) boot {
	b.mac = m.Claims.GetMacs()[0]
	return b
}

// waitUntil polls cond (a goroutine reaching its wait).
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !poll.WaitEvery(10*time.Second, time.Millisecond, cond) {
		t.Fatalf("timed out waiting until %s", what)
	}
}
