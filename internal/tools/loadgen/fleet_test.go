package loadgen_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/tools/loadgen"
)

// Hold mode: the machines join, then each runs bcd's session loop through
// the real gateway to the real API; the status counts the sessions up,
// /nodes names them, and a command enqueued to each is answered.
func TestHoldMode(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		tg := newTarget(t, e, 10)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- loadgen.Hold(ctx, loadgen.Config{BCDConfig: tg.configPath, Token: tg.token, Machines: 4, Concurrency: 2, Seed: t.Name()},
				loadgen.HoldOptions{DataDir: t.TempDir(), Status: addr}, nil)
		}()
		stopped := false
		stop := func() {
			if !stopped {
				stopped = true
				cancel()
				if err := <-done; err != nil {
					t.Errorf("Hold: %v", err)
				}
			}
		}
		defer stop()
		get := func(path string, v any) error {
			res, err := http.Get("http://" + addr + path)
			if err != nil {
				return err
			}
			defer res.Body.Close()
			return json.NewDecoder(res.Body).Decode(v)
		}
		var st loadgen.HoldStatus
		poll.UntilDetail(t, 60*time.Second, func() string { return fmt.Sprintf("4 sessions up: %+v", st) }, func() bool {
			return get(fmt.Sprintf("/status?since=%d", time.Now().Add(-time.Hour).UnixNano()), &st) == nil && st.Up == 4 && st.UpSince == 4
		})
		if st.Nodes != 4 || st.Joined != 4 || st.Running != 4 || st.Welcomes != 4 || st.Exited != 0 {
			t.Fatalf("status %+v", st)
		}
		// A Welcome before since does not count as back.
		if err := get(fmt.Sprintf("/status?since=%d", time.Now().Add(time.Hour).UnixNano()), &st); err != nil || st.UpSince != 0 || st.Up != 4 {
			t.Fatalf("since later: %+v %v", st, err)
		}
		var ids []string
		if err := get("/nodes", &ids); err != nil || len(ids) != 4 {
			t.Fatalf("nodes %v %v", ids, err)
		}
		var cmds []string
		for _, id := range ids {
			res, err := e.Admin.Commands.EnqueueCommand(ctx, connect.NewRequest(&bcv1.EnqueueCommandRequest{TenantId: e.RootTenant, NodeId: id, Kind: "node.facts", TtlSeconds: 60}))
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
		stop()
	})
}

func TestHoldRejectsBadArguments(t *testing.T) {
	for _, c := range []struct {
		cfg  loadgen.Config
		opts loadgen.HoldOptions
	}{
		{loadgen.Config{Machines: 0, Concurrency: 1}, loadgen.HoldOptions{DataDir: "d", Status: "127.0.0.1:0"}},
		{loadgen.Config{Machines: 1, Concurrency: 1}, loadgen.HoldOptions{Status: "127.0.0.1:0"}},
		{loadgen.Config{Machines: 1, Concurrency: 1}, loadgen.HoldOptions{DataDir: "d"}},
	} {
		if err := loadgen.Hold(context.Background(), c.cfg, c.opts, nil); err == nil {
			t.Errorf("%+v %+v: accepted", c.cfg, c.opts)
		}
	}
}

func TestKindFigures(t *testing.T) {
	const mib = 1 << 20
	k := loadgen.KindFigures("gateway", 2000, 10, []int64{50 * mib, 50 * mib},
		[]loadgen.ProcSample{{CPU: 1}, {CPU: 2}}, []loadgen.ProcSample{{CPU: 2, RSS: 150 * mib}, {CPU: 4, RSS: 150 * mib}})
	near := func(got, want float64) bool { return math.Abs(got-want) < 1e-9 }
	// 200 MiB over 2,000 sessions; 3 s of CPU in 10 s; 0.3 cores for
	// 2,000 nodes is 1.5 for 10,000.
	if k.Processes != 2 || !near(k.RSSMiB, 300) || !near(k.IdleRSSMiB, 100) || !near(k.RSSKiBPerSession, 102.4) ||
		!near(k.CPUCores, 0.3) || !near(k.CPUCoresPer10k, 1.5) {
		t.Fatalf("%+v", k)
	}
	// No idle figure: the whole RSS counts; no sessions or no time: no
	// per-session or per-node figures rather than a division by zero.
	k = loadgen.KindFigures("loadgen", 1024, 0, nil, nil, []loadgen.ProcSample{{RSS: 1 * mib}})
	if !near(k.RSSKiBPerSession, 1) || k.CPUCores != 0 || k.CPUCoresPer10k != 0 {
		t.Fatalf("%+v", k)
	}
	k = loadgen.KindFigures("api", 0, 10, nil, []loadgen.ProcSample{{}}, []loadgen.ProcSample{{CPU: 1, RSS: mib}})
	if k.RSSKiBPerSession != 0 || !near(k.CPUCores, 0.1) || k.CPUCoresPer10k != 0 {
		t.Fatalf("%+v", k)
	}
}

func TestMetricSum(t *testing.T) {
	text := `# HELP bc_renewals_total Renewals.
# TYPE bc_renewals_total counter
bc_renewals_total{outcome="admitted",reason="",role="node"} 7
bc_renewals_total{outcome="admitted",reason="",role="site"} 2
bc_renewals_total{outcome="refused",reason="superseded",role="node"} 1
bc_renewals_total_extra 100
bc_session_heartbeats_total 1.5e3
bc_commands_total{event="answered"} 12
`
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"bc_renewals_total", nil, 10},
		{"bc_renewals_total", []string{"outcome", "admitted"}, 9},
		{"bc_renewals_total", []string{"outcome", "admitted", "role", "site"}, 2},
		{"bc_session_heartbeats_total", nil, 1500},
		{"bc_commands_total", []string{"event", "answered"}, 12},
		{"bc_commands_total", []string{"event", "expired"}, 0},
		{"bc_absent", nil, 0},
	} {
		if got := loadgen.MetricSum(text, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

func TestLoadFleetPlan(t *testing.T) {
	dir := t.TempDir()
	write := func(p loadgen.FleetPlan) string {
		b, err := json.Marshal(p)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, "plan.json")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	good := loadgen.FleetPlan{Nodes: 3, API: loadgen.Proc{PID: 1, Argv: []string{"serve"}}, Gateways: []loadgen.Proc{{PID: 2}},
		Holders: []loadgen.HolderProc{{Nodes: 2}, {Nodes: 1}}}
	p, err := loadgen.LoadFleetPlan(write(good))
	if err != nil || p.CommandKind != "node.facts" || len(p.Holders) != 2 || p.Holders[1].Nodes != 1 {
		t.Fatalf("%+v %v", p, err)
	}
	// Conduct checks the plan before starting anything.
	bad := []func(p *loadgen.FleetPlan){
		func(p *loadgen.FleetPlan) { p.Nodes = 4 },
		func(p *loadgen.FleetPlan) { p.Holders[0].Gateway = 1 },
		func(p *loadgen.FleetPlan) { p.API.PID = 0 },
		func(p *loadgen.FleetPlan) { p.Gateways = nil },
	}
	for i, mutate := range bad {
		p := good
		p.Holders = append([]loadgen.HolderProc(nil), good.Holders...)
		mutate(&p)
		if _, err := loadgen.Conduct(context.Background(), p, loadgen.FleetOptions{}, nil); err == nil || !strings.Contains(err.Error(), "plan") {
			t.Errorf("bad plan %d: %v", i, err)
		}
	}
	if _, err := loadgen.LoadFleetPlan(filepath.Join(dir, "none.json")); err == nil {
		t.Error("a missing plan loaded")
	}
}
