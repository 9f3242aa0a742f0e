package loadgen_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/tools/loadgen"
)

// holding is a hold-mode process run by a test, and its status.
type holding struct {
	addr string
	stop func()
}

// startHold runs loadgen.Hold until the test ends (or stop).
func startHold(t *testing.T, cfg loadgen.Config, opts loadgen.HoldOptions) *holding {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	opts.Status = ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- loadgen.Hold(ctx, cfg, opts, nil) }()
	stopped := false
	h := &holding{addr: opts.Status, stop: func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Hold: %v", err)
			}
		}
	}}
	t.Cleanup(h.stop)
	return h
}

func (h *holding) get(path string, v any) error {
	res, err := http.Get("http://" + h.addr + path)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	return json.NewDecoder(res.Body).Decode(v)
}

// status is the holder's status counting sessions welcomed since since.
func (h *holding) status(since time.Time) (loadgen.HoldStatus, error) {
	var st loadgen.HoldStatus
	err := h.get(fmt.Sprintf("/status?since=%d", since.UnixNano()), &st)
	return st, err
}

// counter sums a counter of reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// Lean hold mode (R12.1, R12.3): every lean daemon holds a real session
// through the real gateway to the real API: the API counts it connected,
// verifies its heartbeats (MAC'd when the API agrees a heartbeat key,
// else signed), stores the signed answer of a command enqueued to it, and
// after the gateway restarted every daemon is back on a new session. The
// daemons' timers run on a fake clock: the test moves it for the
// heartbeats and the reconnect waits.
func TestLeanHold(t *testing.T) {
	for _, mac := range []bool{true, false} {
		t.Run(fmt.Sprintf("mac=%v", mac), func(t *testing.T) {
			const nodes = 4
			reg := prometheus.NewRegistry()
			e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{HeartbeatMAC: mac, Metrics: apimetrics.NewAPI(reg)})
			tg := newTarget(t, e, nodes+2)
			fc := clock.NewFake(time.Now())
			h := startHold(t, loadgen.Config{BCDConfig: tg.configPath, Token: tg.token, Machines: nodes, Concurrency: 2, Seed: t.Name()},
				loadgen.HoldOptions{Lean: true, Clock: fc})
			start := time.Now()
			var st loadgen.HoldStatus
			poll.UntilDetail(t, 60*time.Second, func() string { return fmt.Sprintf("%d sessions up: %+v", nodes, st) }, func() bool {
				st, _ = h.status(start.Add(-time.Hour))
				return st.Up == nodes && st.UpSince == nodes
			})
			if st.Nodes != nodes || st.Joined != nodes || st.Running != nodes || st.Welcomes != nodes || st.Exited != 0 {
				t.Fatalf("status %+v", st)
			}
			var ids []string
			if err := h.get("/nodes", &ids); err != nil || len(ids) != nodes {
				t.Fatalf("nodes %v %v", ids, err)
			}
			for _, id := range ids {
				poll.Until(t, 30*time.Second, "the API holds the session of "+id, func() bool { return e.Server.Sessions().Connected(id) })
			}

			// Heartbeats, at the interval Welcome named: the API verified
			// them.
			poll.UntilDetail(t, 60*time.Second, func() string {
				return fmt.Sprintf("%d heartbeats verified by the API (%v)", nodes, counter(t, reg, telemetry.SessionHeartbeats))
			}, func() bool {
				fc.Advance(time.Second)
				return counter(t, reg, telemetry.SessionHeartbeats) >= nodes
			})

			// A command to each: verified, run, answered signed, stored.
			ctx := context.Background()
			var cmds []string
			for _, id := range ids {
				res, err := e.Admin.Commands.EnqueueCommand(ctx, connect.NewRequest(&bcv1.EnqueueCommandRequest{TenantId: e.RootTenant, NodeId: id, Kind: "node.facts", TtlSeconds: 600}))
				if err != nil {
					t.Fatal(err)
				}
				cmds = append(cmds, res.Msg.Id)
			}
			for _, id := range cmds {
				var state string
				poll.UntilDetail(t, 60*time.Second, func() string { return "command " + id + " done, is " + state }, func() bool {
					res, err := e.Admin.Commands.GetCommand(ctx, connect.NewRequest(&bcv1.GetCommandRequest{TenantId: e.RootTenant, CommandId: id}))
					if err == nil {
						state = res.Msg.State
					}
					return state == "done"
				})
			}
			if st, err := h.status(start); err != nil || st.Commands < nodes {
				t.Fatalf("commands answered: %+v %v", st, err)
			}

			// The gateway restarts: every daemon comes back on a new
			// session within the first reconnect's spread (moved on the
			// fake clock).
			restarted := time.Now()
			tg.gw.restart(t)
			poll.UntilDetail(t, 60*time.Second, func() string { return fmt.Sprintf("%d sessions back: %+v", nodes, st) }, func() bool {
				fc.Advance(time.Second)
				st, _ = h.status(restarted)
				return st.Up == nodes && st.UpSince == nodes
			})
			if st.Welcomes < 2*nodes || st.EndsOther < nodes || st.Exited != 0 {
				t.Fatalf("after the restart: %+v", st)
			}
			h.stop()
		})
	}
}

// Lean hold mode renews (R13.1): with 60-second certificates (the API's
// shortest) every
// daemon renews at 45% to 75% of the lifetime over its session's
// connection, the API records the new certificate, and the daemon's next
// session opens on it at once (an end counted as the renewal's). Real
// time: the API dates the proof of possession.
func TestLeanHoldRenews(t *testing.T) {
	const nodes = 3
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{CertTTL: time.Minute})
	tg := newTarget(t, e, nodes+2)
	h := startHold(t, loadgen.Config{BCDConfig: tg.configPath, Token: tg.token, Machines: nodes, Concurrency: 2, Seed: t.Name()},
		loadgen.HoldOptions{Lean: true})
	var certs map[string]int
	poll.UntilDetail(t, 90*time.Second, func() string { return fmt.Sprintf("every node renewed: certificates per node %v", certs) }, func() bool {
		certs = certsPerNode(t, e)
		for _, n := range certs {
			if n < 2 {
				return false
			}
		}
		return len(certs) == nodes
	})
	var st loadgen.HoldStatus
	poll.UntilDetail(t, 60*time.Second, func() string { return fmt.Sprintf("sessions on the new certificates: %+v", st) }, func() bool {
		st, _ = h.status(time.Time{})
		return st.Renewed >= nodes && st.EndsRenewal >= nodes && st.Welcomes >= 2*nodes && st.Up == nodes
	})
	if st.Exited != 0 {
		t.Fatalf("status %+v", st)
	}
	h.stop()
}
