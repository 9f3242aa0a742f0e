package join_test

import (
	"context"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R4.7: the refusal limit holds across replicas. Three
// JoinServices, each on its own store handle of one PostgreSQL (three API
// replicas, each with its own limiter), refuse 100 joins each at once: 60
// events are recorded, not 180, and the events of the next minute carry
// the other 240 as suppressed.
func TestRefusalLimitAcrossReplicasR4_7(t *testing.T) {
	dbs := storetest.PostgresReplicas(t, 3)
	e := apitest.Start(t, dbs[0], apitest.Options{})
	f := newFixture(t, e)
	start := time.Now()
	var clocks []*clock.Fake
	var svcs []*join.Service
	for _, db := range dbs {
		replica := *e
		replica.DB = db
		clk := clock.NewFake(start)
		clocks = append(clocks, clk)
		// A nil limiter: each replica gets nodeident's default, 60 a minute.
		svcs = append(svcs, ownService(t, &replica, clk, nil, 0))
	}
	bad := jointest.NewMachine(t, jointest.Claims(1)).Request(t, e.Bundle, "", "")
	bad.SealedToken = "a.b.c.d.e"
	refuse := func(svc *join.Service, req *agentv1.JoinRequest) {
		_, err := svc.Join(context.Background(), req, join.Peer{})
		jointest.WantRefused(t, err)
	}
	var wg sync.WaitGroup
	for _, svc := range svcs {
		for range 4 {
			wg.Go(func() {
				for range 25 {
					refuse(svc, bad)
				}
			})
		}
	}
	wg.Wait()
	malformed := func() (n, suppressed int) {
		for _, r := range jointest.Refusals(t, e.DB, f.root) {
			if r.Reason == reason("seal-malformed") {
				n, suppressed = n+1, suppressed+r.Suppressed
			}
		}
		return n, suppressed
	}
	if n, s := malformed(); n != 60 || s != 0 {
		t.Fatalf("3 replicas recorded %d refusal events (suppressed %d) for 300 refusals in a minute, want 60 (0)", n, s)
	}
	// The next minute: one refusal through each replica hands over what
	// each dropped.
	for i, svc := range svcs {
		clocks[i].Advance(time.Minute)
		refuse(svc, bad)
	}
	if n, s := malformed(); n != 63 || s != 240 {
		t.Fatalf("after the window: %d events suppressing %d in all, want 63 and 240", n, s)
	}
}
