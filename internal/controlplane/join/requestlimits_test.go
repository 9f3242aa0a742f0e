package join_test

import (
	"context"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// enrollingEnv is a tpm attestor whose only pool enrolls unknown EKs, with
// JoinService's join-request limits set to lim.
func enrollingEnv(t *testing.T, f *fixture, lim join.RequestLimits) *tpmEnv {
	return newTPMEnvWith(t, f, func(*tpmtest.Sim, *tpmdevice.TPM) []tpm.Pool {
		return []tpm.Pool{{PoolID: f.pool.Id, Enrollment: true}}
	}, func(c *join.Config) { c.Limits = lim })
}

// withTPM is env with the machine's TPM replaced: another machine (another
// EK) joining through the same JoinService.
func (e *tpmEnv) withTPM(tp *tpmdevice.TPM) *tpmEnv {
	c := *e
	c.tp = tp
	return &c
}

// pendingRequests counts the pool's pending join requests.
func (f *fixture) pendingRequests(t *testing.T) int {
	t.Helper()
	var rs []store.JoinRequest
	f.read(t, func(tx *store.Tx) (err error) {
		rs, err = tx.ListJoinRequests(context.Background(), f.root, f.pool.Id, []string{store.JoinRequestPending}, "", 1000)
		return
	})
	return len(rs)
}

// R15.4: unknown EKs that enroll make at most MaxPendingPerPool pending
// requests in a pool; past it a new one is refused with its own reason and
// writes no request, while a machine already waiting keeps waiting.
func TestEnrollmentPoolLimitR15_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := enrollingEnv(t, f, join.RequestLimits{MaxPendingPerPool: 2, MaxPendingPerSource: 100})
		machines := []*tpmEnv{env, env.withTPM(tpmtest.StartFresh(t).Open(t)), env.withTPM(tpmtest.StartFresh(t).Open(t))}
		for i, m := range machines[:2] {
			res, _, err := m.join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.10:1"})
			if err != nil || res.GetBody() == nil {
				t.Fatalf("machine %d: %v, want a deferral", i, err)
			}
		}
		_, _, err := machines[2].join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.11:1"})
		jointest.WantRefused(t, err)
		if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+join.ReasonPendingPoolLimit) {
			t.Fatalf("reasons %v, want %s", rs, join.ReasonPendingPoolLimit)
		}
		if n := f.pendingRequests(t); n != 2 {
			t.Fatalf("%d pending requests, want 2", n)
		}
		// A machine that already waits is not a new request: it still
		// gets its deferral.
		if res, _, err := machines[0].join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.10:1"}); err != nil || res.GetBody() == nil {
			t.Fatalf("a waiting machine asking again: %v, want a deferral", err)
		}
	})
}

// R15.4: one source address makes at most MaxPendingPerSource pending
// requests, across pools; another source still may.
func TestEnrollmentSourceLimitR15_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := enrollingEnv(t, f, join.RequestLimits{MaxPendingPerPool: 100, MaxPendingPerSource: 1})
		if _, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.20:5000"}); err != nil {
			t.Fatal(err)
		}
		other := env.withTPM(tpmtest.StartFresh(t).Open(t))
		// The same host from another port is the same source.
		_, _, err := other.join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.20:5001"})
		jointest.WantRefused(t, err)
		if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+join.ReasonPendingSourceLimit) {
			t.Fatalf("reasons %v, want %s", rs, join.ReasonPendingSourceLimit)
		}
		if res, _, err := other.join(t, tpmReq{kind: tpmdevice.EKP256, peer: "192.0.2.21:5000"}); err != nil || res.GetBody() == nil {
			t.Fatalf("from another source: %v, want a deferral", err)
		}
		if n := f.pendingRequests(t); n != 2 {
			t.Fatalf("%d pending requests, want 2", n)
		}
	})
}

// R15.4: one EK that keeps making new node keys refreshes its request at
// most once per RefreshInterval: ten attempts write one request and one
// event, and the next attempt past the interval refreshes it.
func TestEnrollmentRefreshLimitR15_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := enrollingEnv(t, f, join.RequestLimits{})
		for i := 0; i < 10; i++ {
			if res, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256}); err != nil || res.GetBody() == nil {
				t.Fatalf("attempt %d: %v, want a deferral", i, err)
			}
		}
		if got := f.events(t, f.root, "security.join-request."); len(got) != 1 {
			t.Fatalf("%d join-request events after 10 attempts within the interval, want 1 (created)", len(got))
		}
		if got := f.audit(t, f.root, "join-request.created"); len(got) != 1 {
			t.Fatalf("%d audit rows, want 1", len(got))
		}
		if err := e.DB.SetClockOffset(context.Background(), join.DefaultRefreshInterval+1e9); err != nil {
			t.Fatal(err)
		}
		if _, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256}); err != nil {
			t.Fatal(err)
		}
		got := f.events(t, f.root, "security.join-request.")
		if len(got) != 2 || got[1].Type != "security.join-request.refreshed" {
			t.Fatalf("events %+v: want created, then one refresh past the interval", got)
		}
		if n := f.pendingRequests(t); n != 1 {
			t.Fatalf("%d pending requests, want 1", n)
		}
	})
}
