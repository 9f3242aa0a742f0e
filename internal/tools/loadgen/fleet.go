package loadgen

// Fleet mode conducts scripts/bench-fleet: given the API and gateway
// processes the script started and the holding processes to start (hold
// mode, hold.go), it measures what holding the fleet costs and how fast it
// comes back:
//
//  1. the API's and gateways' RSS before any session (idle);
//  2. the holders started: the time until every machine joined and holds a
//     session;
//  3. a steady window of Duration: CPU and RSS of every process, and
//     heartbeats, renewals and session ends per second;
//  4. a command enqueued to every node: the time until every result is
//     stored;
//  5. kill -9 of the first gateway and its restart: the time until its
//     daemons are back (each welcomed after the kill), the others still up;
//  6. kill -9 of the API and its restart: the time until every daemon is
//     back.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// FleetPlan is what scripts/bench-fleet set up (a JSON file).
type FleetPlan struct {
	Nodes          int    `json:"nodes"`
	Store          string `json:"store"`
	CertTTLSeconds int    `json:"certTtlSeconds"`
	// API and Gateways are running (PID set); Argv restarts them.
	API      Proc   `json:"api"`
	Gateways []Proc `json:"gateways"`
	// Holders are started by the conductor.
	Holders []HolderProc `json:"holders"`
	// APIMetrics is the API's /metrics URL.
	APIMetrics string `json:"apiMetrics"`
	// Operator is how commands are enqueued.
	OperatorURL string `json:"operatorUrl"`
	APIKey      string `json:"apiKey"`
	Tenant      string `json:"tenant"`
	CommandKind string `json:"commandKind"`
}

// Proc is one process of the run.
type Proc struct {
	PID  int      `json:"pid"`
	Argv []string `json:"argv"`
	// Log receives the output of a process the conductor starts.
	Log string `json:"log"`
	// Ready is an http:// URL that answers 200, or tcp:host:port that
	// accepts, once the process is ready.
	Ready string `json:"ready"`
}

// HolderProc is a holding process (bc-loadgen --mode hold).
type HolderProc struct {
	Proc
	// Status is its status URL (http://addr).
	Status string `json:"status"`
	Nodes  int    `json:"nodes"`
	// Gateway is the index in FleetPlan.Gateways its daemons dial.
	Gateway int `json:"gateway"`
}

// FleetOptions tune the conductor.
type FleetOptions struct {
	// Duration is the steady window.
	Duration time.Duration
	// Timeout bounds each wait (default 10 minutes).
	Timeout time.Duration
}

// FleetReport is what a fleet run measured.
type FleetReport struct {
	Nodes          int     `json:"nodes"`
	Store          string  `json:"store"`
	Gateways       int     `json:"gateways"`
	Holders        int     `json:"holders"`
	CertTTLSeconds int     `json:"certTtlSeconds"`
	SteadySeconds  float64 `json:"steadySeconds"`
	// QuietSeconds is the part of the steady window before the first
	// renewal (0: a renewal came within the first 10 s).
	QuietSeconds float64 `json:"quietSeconds"`
	// HoldSeconds is from the holders' start to every session up (joins
	// included).
	HoldSeconds float64      `json:"holdSeconds"`
	Processes   []KindReport `json:"processes"`
	// Over the steady window, at the API: heartbeats verified and
	// renewals admitted per second; at the daemons: sessions ended by a
	// renewal and otherwise.
	HeartbeatsPerSecond float64 `json:"heartbeatsPerSecond"`
	RenewalsPerSecond   float64 `json:"renewalsPerSecond"`
	SessionEndsRenewal  int64   `json:"sessionEndsRenewal"`
	SessionEndsOther    int64   `json:"sessionEndsOther"`
	Command             *Timed  `json:"command,omitempty"`
	GatewayKill         *Timed  `json:"gatewayKill,omitempty"`
	APIKill             *Timed  `json:"apiKill,omitempty"`
	// Over the whole run, at the daemons.
	RenewFailed int64          `json:"renewFailed"`
	Exited      int64          `json:"exited"`
	Errors      map[string]int `json:"errors,omitempty"`
}

// KindReport is one kind of process (api, gateway, loadgen) over the
// steady window, summed over its processes.
type KindReport struct {
	Kind      string `json:"kind"`
	Processes int    `json:"processes"`
	Sessions  int    `json:"sessions"`
	// RSSMiB at the end of the window; IdleRSSMiB before any session (0:
	// not measured).
	RSSMiB     float64 `json:"rssMiB"`
	IdleRSSMiB float64 `json:"idleRssMiB"`
	// RSSKiBPerSession is (RSS - idle RSS) / sessions.
	RSSKiBPerSession float64 `json:"rssKiBPerSession"`
	// CPUCores is the CPU used over the window (1 = one core busy);
	// CPUCoresPer10k scaled to 10,000 nodes.
	CPUCores       float64 `json:"cpuCores"`
	CPUCoresPer10k float64 `json:"cpuCoresPer10kNodes"`
	// QuietCPUCores and QuietCPUCoresPer10k are the same over the part
	// of the window before the first renewal (heartbeats alone).
	QuietCPUCores       float64 `json:"quietCpuCores"`
	QuietCPUCoresPer10k float64 `json:"quietCpuCoresPer10kNodes"`
}

// Timed is a phase's duration and what it covered.
type Timed struct {
	Seconds float64 `json:"seconds"`
	// Nodes is how many nodes the phase waited for; Done how many made
	// it (commands: results stored as done).
	Nodes int `json:"nodes"`
	Done  int `json:"done"`
	// Errors counts failures of the phase's own calls (enqueues).
	Errors int `json:"errors,omitempty"`
}

// ProcSample is one process's CPU (seconds) and RSS (bytes).
type ProcSample struct {
	CPU float64
	RSS int64
}

// KindFigures computes a KindReport from samples at the start and the end
// of a window of seconds; idle (may be nil) is each process's RSS before
// any session.
func KindFigures(kind string, sessions int, seconds float64, idle []int64, start, end []ProcSample) KindReport {
	k := KindReport{Kind: kind, Processes: len(end), Sessions: sessions}
	var rss, idleSum int64
	var cpu float64
	for i, e := range end {
		rss += e.RSS
		if i < len(start) {
			cpu += e.CPU - start[i].CPU
		}
	}
	for _, r := range idle {
		idleSum += r
	}
	k.RSSMiB = float64(rss) / (1 << 20)
	k.IdleRSSMiB = float64(idleSum) / (1 << 20)
	if sessions > 0 {
		k.RSSKiBPerSession = float64(rss-idleSum) / 1024 / float64(sessions)
	}
	if seconds > 0 {
		k.CPUCores = cpu / seconds
		if sessions > 0 {
			k.CPUCoresPer10k = k.CPUCores * 10000 / float64(sessions)
		}
	}
	return k
}

// MetricSum sums the series of name in a Prometheus text exposition whose
// labels include every `k="v"` of labels (pairs).
func MetricSum(text, name string, labels ...string) float64 {
	var sum float64
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' || !strings.HasPrefix(line, name) {
			continue
		}
		rest := line[len(name):]
		lbl := ""
		if strings.HasPrefix(rest, "{") {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			lbl, rest = rest[1:end], rest[end+1:]
		}
		if rest == "" || rest[0] != ' ' {
			continue // another metric with name as prefix
		}
		ok := true
		for i := 0; i+1 < len(labels); i += 2 {
			if !strings.Contains(lbl, labels[i]+`="`+labels[i+1]+`"`) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			sum += v
		}
	}
	return sum
}

// conductor runs one fleet measurement.
type conductor struct {
	plan     FleetPlan
	opts     FleetOptions
	progress func(string)
	hc       *http.Client
	// started are the processes the conductor started, by pid.
	mu      sync.Mutex
	started map[int]*exec.Cmd
}

// Conduct runs the phases and returns what they measured; the processes it
// started are stopped before it returns.
func Conduct(ctx context.Context, plan FleetPlan, opts FleetOptions, progress func(string)) (*FleetReport, error) {
	if progress == nil {
		progress = func(string) {}
	}
	if err := plan.check(); err != nil {
		return nil, err
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Minute
	}
	c := &conductor{plan: plan, opts: opts, progress: progress, hc: &http.Client{Timeout: 30 * time.Second}, started: map[int]*exec.Cmd{}}
	defer c.stopAll()
	r := &FleetReport{Nodes: plan.Nodes, Store: plan.Store, Gateways: len(plan.Gateways), Holders: len(plan.Holders), CertTTLSeconds: plan.CertTTLSeconds}
	err := c.run(ctx, r)
	if st, serr := c.statuses(0); serr == nil {
		for _, s := range st {
			r.RenewFailed += s.RenewFailed
			r.Exited += s.Exited
			for k, v := range s.Errors {
				if r.Errors == nil {
					r.Errors = map[string]int{}
				}
				r.Errors[k] += v
			}
		}
	}
	return r, err
}

func (p *FleetPlan) check() error {
	n := 0
	for _, h := range p.Holders {
		if h.Gateway < 0 || h.Gateway >= len(p.Gateways) {
			return errs.New(errs.InvalidArgument, "plan: holder gateway %d of %d", h.Gateway, len(p.Gateways))
		}
		n += h.Nodes
	}
	switch {
	case p.Nodes <= 0 || n != p.Nodes:
		return errs.New(errs.InvalidArgument, "plan: %d nodes, the holders hold %d", p.Nodes, n)
	case p.API.PID <= 0 || len(p.API.Argv) == 0 || len(p.Gateways) == 0:
		return errs.New(errs.InvalidArgument, "plan: the API and at least one gateway must be running, with their command lines")
	}
	return nil
}

func (c *conductor) run(ctx context.Context, r *FleetReport) error {
	p := &c.plan
	idleAPI := []int64{rssOf(p.API.PID)}
	var idleGW []int64
	for _, g := range p.Gateways {
		idleGW = append(idleGW, rssOf(g.PID))
	}
	c.progress(fmt.Sprintf("starting %d holding processes for %d nodes…", len(p.Holders), p.Nodes))
	t0 := time.Now()
	for i := range p.Holders {
		if err := c.start(ctx, &p.Holders[i].Proc); err != nil {
			return err
		}
	}
	if _, err := c.waitBack(ctx, "every node joined and holding a session", 0, -1); err != nil {
		return err
	}
	r.HoldSeconds = time.Since(t0).Seconds()
	c.progress(fmt.Sprintf("all %d sessions up after %.1f s; steady window of %s…", p.Nodes, r.HoldSeconds, c.opts.Duration))
	if err := c.steady(ctx, r, idleAPI, idleGW); err != nil {
		return err
	}
	var err error
	if r.Command, err = c.command(ctx); err != nil {
		return err
	}
	if r.GatewayKill, err = c.kill(ctx, "gateway", &p.Gateways[0], 0); err != nil {
		return err
	}
	r.APIKill, err = c.kill(ctx, "api", &p.API, -1)
	return err
}

// steady samples every process over the steady window.
func (c *conductor) steady(ctx context.Context, r *FleetReport, idleAPI, idleGW []int64) error {
	p := &c.plan
	procs := func() (api, gw, lg []int) {
		api = []int{p.API.PID}
		for _, g := range p.Gateways {
			gw = append(gw, g.PID)
		}
		for _, h := range p.Holders {
			lg = append(lg, h.PID)
		}
		return
	}
	api, gw, lg := procs()
	m0, err := c.metrics()
	if err != nil {
		return err
	}
	st0, err := c.statuses(0)
	if err != nil {
		return err
	}
	s0 := [3][]ProcSample{samples(api), samples(gw), samples(lg)}
	renewed := func(st []HoldStatus) (n int64) {
		for _, s := range st {
			n += s.Renewed
		}
		return n
	}
	// The quiet part of the window: from its start to the last sample
	// before the first renewal (heartbeats alone).
	quiet, quietAt, quietOver := s0, time.Now(), false
	start := time.Now()
	for left := c.opts.Duration; left > 0; left = c.opts.Duration - time.Since(start) {
		if err := sleepCtx(ctx, min(left, 10*time.Second)); err != nil {
			return err
		}
		st, err := c.statuses(0)
		if err != nil {
			return err
		}
		if !quietOver && renewed(st) == renewed(st0) {
			quiet, quietAt = [3][]ProcSample{samples(api), samples(gw), samples(lg)}, time.Now()
		} else {
			quietOver = true
		}
		c.progress(fmt.Sprintf("steady: %s in, %d/%d up, %d renewals", time.Since(start).Round(time.Second), upOf(st), p.Nodes, renewed(st)-renewed(st0)))
	}
	secs := time.Since(start).Seconds()
	s1 := [3][]ProcSample{samples(api), samples(gw), samples(lg)}
	// Without the last scrape the processes' figures still count; the
	// API's rates stay 0.
	m1, merr := c.metrics()
	if merr != nil {
		c.progress(fmt.Sprintf("no heartbeat and renewal rates: %v", merr))
		m1 = m0
	}
	st1, err := c.statuses(0)
	if err != nil {
		return err
	}
	r.SteadySeconds = secs
	r.Processes = []KindReport{
		KindFigures("api", p.Nodes, secs, idleAPI, s0[0], s1[0]),
		KindFigures("gateway", p.Nodes, secs, idleGW, s0[1], s1[1]),
		KindFigures("loadgen", p.Nodes, secs, nil, s0[2], s1[2]),
	}
	if r.QuietSeconds = quietAt.Sub(start).Seconds(); r.QuietSeconds > 0 {
		for i := range r.Processes {
			q := KindFigures("", p.Nodes, r.QuietSeconds, nil, s0[i], quiet[i])
			r.Processes[i].QuietCPUCores, r.Processes[i].QuietCPUCoresPer10k = q.CPUCores, q.CPUCoresPer10k
		}
	}
	r.HeartbeatsPerSecond = (MetricSum(m1, telemetry.SessionHeartbeats) - MetricSum(m0, telemetry.SessionHeartbeats)) / secs
	admitted := func(m string) float64 { return MetricSum(m, telemetry.Renewals, telemetry.LabelOutcome, "admitted") }
	r.RenewalsPerSecond = (admitted(m1) - admitted(m0)) / secs
	for i := range st1 {
		r.SessionEndsRenewal += st1[i].EndsRenewal - st0[i].EndsRenewal
		r.SessionEndsOther += st1[i].EndsOther - st0[i].EndsOther
	}
	return nil
}

// command enqueues a command to every node and waits until every result
// is stored.
func (c *conductor) command(ctx context.Context) (*Timed, error) {
	p := &c.plan
	var ids []string
	for _, h := range p.Holders {
		var got []string
		if err := c.getJSON(h.Status+"/nodes", &got); err != nil {
			return nil, err
		}
		ids = append(ids, got...)
	}
	cl, err := client.New(client.Config{URL: p.OperatorURL, APIKey: p.APIKey})
	if err != nil {
		return nil, err
	}
	m0, err := c.metrics()
	if err != nil {
		return nil, err
	}
	answered := func(m string) float64 {
		return MetricSum(m, telemetry.Commands, telemetry.LabelEvent, telemetry.CommandAnswered)
	}
	c.progress(fmt.Sprintf("enqueuing %s to %d nodes…", p.CommandKind, len(ids)))
	start := time.Now()
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < len(ids) && ctx.Err() == nil; i = int(next.Add(1)) - 1 {
				_, err := cl.Commands.EnqueueCommand(ctx, connect.NewRequest(&bcv1.EnqueueCommandRequest{
					TenantId: p.Tenant, NodeId: ids[i], Kind: p.CommandKind, TtlSeconds: 600}))
				if err != nil {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	t := &Timed{Nodes: len(ids), Errors: int(failed.Load())}
	want := float64(len(ids) - t.Errors)
	c.progress(fmt.Sprintf("enqueued %d in %.1f s (%d failed); waiting for the results…", int(want), time.Since(start).Seconds(), t.Errors))
	err = c.poll(ctx, func() (bool, string, error) {
		m, err := c.metrics()
		if err != nil {
			return false, "", err
		}
		got := answered(m) - answered(m0)
		return got >= want, fmt.Sprintf("%d/%d results stored", int(got), int(want)), nil
	})
	t.Seconds = time.Since(start).Seconds()
	if err != nil {
		return t, err
	}
	t.Done, err = c.commandsDone(ctx, cl)
	return t, err
}

// commandsDone counts the tenant's commands stored as done.
func (c *conductor) commandsDone(ctx context.Context, cl *client.Client) (int, error) {
	done, tok := 0, ""
	for {
		res, err := cl.Commands.ListCommands(ctx, connect.NewRequest(&bcv1.ListCommandsRequest{TenantId: c.plan.Tenant, PageSize: 200, PageToken: tok}))
		if err != nil {
			return done, err
		}
		for _, it := range res.Msg.GetItems() {
			if it.GetState() == "done" {
				done++
			}
		}
		if tok = res.Msg.GetNextPageToken(); tok == "" {
			return done, nil
		}
	}
}

// kill kills p with SIGKILL, restarts it, and waits until the daemons of
// gateway (-1: every daemon) are back, welcomed after the kill, and the
// others still up.
func (c *conductor) kill(ctx context.Context, what string, p *Proc, gateway int) (*Timed, error) {
	c.progress(fmt.Sprintf("kill -9 of the %s (pid %d), then its restart…", what, p.PID))
	t0 := time.Now()
	if err := c.killHard(p.PID); err != nil {
		return nil, err
	}
	if err := c.start(ctx, p); err != nil {
		return nil, err
	}
	c.progress(fmt.Sprintf("the %s is back after %.1f s (pid %d); waiting for its sessions…", what, time.Since(t0).Seconds(), p.PID))
	n, err := c.waitBack(ctx, "sessions back after the kill of the "+what, t0.UnixNano(), gateway)
	return &Timed{Seconds: time.Since(t0).Seconds(), Nodes: n, Done: n}, err
}

// waitBack waits until the daemons of gateway (-1: all) hold a session
// welcomed at or after since, and every other daemon holds one; it returns
// how many it waited for.
func (c *conductor) waitBack(ctx context.Context, what string, since int64, gateway int) (int, error) {
	want := 0
	for _, h := range c.plan.Holders {
		if gateway < 0 || h.Gateway == gateway {
			want += h.Nodes
		}
	}
	err := c.poll(ctx, func() (bool, string, error) {
		st, err := c.statuses(since)
		if err != nil {
			return false, "", err
		}
		back, up := 0, 0
		for i, h := range c.plan.Holders {
			if st[i].Joined > 0 && st[i].Joined < h.Nodes {
				return false, "", fmt.Errorf("holder %d: only %d of %d machines joined: %v", i, st[i].Joined, h.Nodes, st[i].Errors)
			}
			if gateway < 0 || h.Gateway == gateway {
				back += st[i].UpSince
			}
			up += st[i].Up
		}
		return back == want && up == c.plan.Nodes, fmt.Sprintf("%s: %d/%d (%d/%d up)", what, back, want, up, c.plan.Nodes), nil
	})
	return want, err
}

// poll calls f every second until it reports done, fails, or the timeout
// passes, printing its progress line every 5 s.
func (c *conductor) poll(ctx context.Context, f func() (bool, string, error)) error {
	deadline := time.Now().Add(c.opts.Timeout)
	last := time.Now()
	for {
		if err := c.holdersAlive(); err != nil {
			return err
		}
		done, line, err := f()
		if err != nil || done {
			return err
		}
		if time.Since(last) >= 5*time.Second {
			c.progress(line)
			last = time.Now()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s: %s", c.opts.Timeout, line)
		}
		if err := sleepCtx(ctx, 250*time.Millisecond); err != nil {
			return err
		}
	}
}

func (c *conductor) holdersAlive() error {
	for i, h := range c.plan.Holders {
		if !alive(h.PID) {
			return fmt.Errorf("holder %d (pid %d) exited; see %s", i, h.PID, h.Log)
		}
	}
	return nil
}

func (c *conductor) statuses(since int64) ([]HoldStatus, error) {
	out := make([]HoldStatus, len(c.plan.Holders))
	for i, h := range c.plan.Holders {
		if err := c.getJSON(h.Status+"/status?since="+strconv.FormatInt(since, 10), &out[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func upOf(st []HoldStatus) int {
	n := 0
	for _, s := range st {
		n += s.Up
	}
	return n
}

func (c *conductor) getJSON(url string, v any) error {
	var err error
	for range 20 { // a holder starting up does not answer yet
		var res *http.Response
		if res, err = c.hc.Get(url); err == nil {
			err = json.NewDecoder(res.Body).Decode(v)
			res.Body.Close()
			if err == nil {
				return nil
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("read %s: %w", url, err)
}

// metrics reads the API's /metrics, retrying a few times: a loaded API
// can fail a scrape (a collector's query timing out).
func (c *conductor) metrics() (string, error) {
	var err error
	for range 5 {
		var m string
		if m, err = c.metricsOnce(); err == nil {
			return m, nil
		}
		time.Sleep(2 * time.Second)
	}
	return "", err
}

func (c *conductor) metricsOnce() (string, error) {
	res, err := c.hc.Get(c.plan.APIMetrics)
	if err != nil {
		return "", err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err == nil && res.StatusCode != http.StatusOK {
		err = fmt.Errorf("%s: %s", c.plan.APIMetrics, res.Status)
	}
	return string(b), err
}

// start starts p's command line, its output appended to p.Log, and waits
// until it is ready; p.PID is set.
func (c *conductor) start(ctx context.Context, p *Proc) error {
	out, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command(p.Argv[0], p.Argv[1:]...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	p.PID = cmd.Process.Pid
	c.mu.Lock()
	c.started[p.PID] = cmd
	c.mu.Unlock()
	if p.Ready == "" {
		return nil
	}
	return c.poll(ctx, func() (bool, string, error) {
		if !alive(p.PID) {
			return false, "", fmt.Errorf("%s exited; see %s", p.Argv[0], p.Log)
		}
		return ready(c.hc, p.Ready), "waiting for " + p.Ready, nil
	})
}

func ready(hc *http.Client, spec string) bool {
	if addr, ok := strings.CutPrefix(spec, "tcp:"); ok {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
		}
		return err == nil
	}
	res, err := hc.Get(spec)
	if err != nil {
		return false
	}
	res.Body.Close()
	return res.StatusCode == http.StatusOK
}

// killHard sends SIGKILL to pid and waits until it is gone (reaped, or a
// zombie of the script that started it: its sockets and locks are
// released either way).
func (c *conductor) killHard(pid int) error {
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill %d: %w", pid, err)
	}
	c.mu.Lock()
	cmd := c.started[pid]
	delete(c.started, pid)
	c.mu.Unlock()
	if cmd != nil {
		_ = cmd.Wait()
		return nil
	}
	for !released(pid) {
		time.Sleep(20 * time.Millisecond)
	}
	return nil
}

// released reports whether pid is gone, or a zombie whose threads all
// exited. A killed process's leader shows Z while its other threads are
// still exiting, and its sockets (a gateway's listener among thousands of
// connections) are closed only once the last one has: a restart before
// that finds its port taken.
func released(pid int) bool {
	if alive(pid) {
		return false
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	return err != nil || len(tasks) <= 1
}

// stopAll ends the processes the conductor started (SIGTERM, then SIGKILL
// after 30 s) and waits for them.
func (c *conductor) stopAll() {
	c.mu.Lock()
	cmds := c.started
	c.started = map[int]*exec.Cmd{}
	c.mu.Unlock()
	var wg sync.WaitGroup
	for _, cmd := range cmds {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		wg.Add(1)
		go func() {
			defer wg.Done()
			done := make(chan struct{})
			go func() { defer close(done); _ = cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				_ = cmd.Process.Kill()
				<-done
			}
		}()
	}
	wg.Wait()
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// alive reports whether pid runs (not gone, not a zombie).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func samples(pids []int) []ProcSample {
	out := make([]ProcSample, len(pids))
	for i, pid := range pids {
		cpu, _ := cpuTime(pid)
		out[i] = ProcSample{CPU: cpu, RSS: rssOf(pid)}
	}
	return out
}

// rssOf is pid's resident set in bytes (VmRSS), 0 when unreadable.
func rssOf(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// Text is the report for people.
func (r *FleetReport) Text() string {
	var b strings.Builder
	fmt.Fprintf(&b, "fleet: %d nodes on %s, %d gateway(s), %d load-generator process(es), certificates of %d s\n", r.Nodes, r.Store, r.Gateways, r.Holders, r.CertTTLSeconds)
	fmt.Fprintf(&b, "every session up %.1f s after the holders started (joins included)\n", r.HoldSeconds)
	fmt.Fprintf(&b, "steady window %.0f s: %.1f heartbeats/s, %.2f renewals/s at the API; sessions ended by a renewal %d, otherwise %d\n",
		r.SteadySeconds, r.HeartbeatsPerSecond, r.RenewalsPerSecond, r.SessionEndsRenewal, r.SessionEndsOther)
	for _, k := range r.Processes {
		fmt.Fprintf(&b, "  %-8s x%d: RSS %.0f MiB (idle %.0f MiB), %.1f KiB per held session; CPU %.3f cores, %.3f cores per 10,000 nodes (before the first renewal, %.0f s: %.3f per 10,000)\n",
			k.Kind, k.Processes, k.RSSMiB, k.IdleRSSMiB, k.RSSKiBPerSession, k.CPUCores, k.CPUCoresPer10k, r.QuietSeconds, k.QuietCPUCoresPer10k)
	}
	if t := r.Command; t != nil {
		fmt.Fprintf(&b, "a command to every node: %d/%d results stored as done in %.1f s (%d enqueues failed)\n", t.Done, t.Nodes, t.Seconds, t.Errors)
	}
	if t := r.GatewayKill; t != nil {
		fmt.Fprintf(&b, "kill -9 of one gateway and its restart: its %d nodes back in %.1f s\n", t.Nodes, t.Seconds)
	}
	if t := r.APIKill; t != nil {
		fmt.Fprintf(&b, "kill -9 of the API and its restart: all %d nodes back in %.1f s\n", t.Nodes, t.Seconds)
	}
	fmt.Fprintf(&b, "renewal attempts failed %d, daemons exited %d\n", r.RenewFailed, r.Exited)
	keys := make([]string, 0, len(r.Errors))
	for k := range r.Errors {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "  error x%d: %s\n", r.Errors[k], k)
	}
	return b.String()
}

// LoadFleetPlan reads a plan file.
func LoadFleetPlan(path string) (FleetPlan, error) {
	var p FleetPlan
	b, err := os.ReadFile(path)
	if err != nil {
		return p, err
	}
	if err := json.Unmarshal(b, &p); err != nil {
		return p, fmt.Errorf("%s: %w", path, err)
	}
	if p.CommandKind == "" {
		p.CommandKind = "node.facts"
	}
	return p, nil
}
