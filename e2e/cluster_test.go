package e2e

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

const (
	clusterReplicas = 3
	clusterGateways = 2
	clusterDaemons  = 6    // real bcd run processes holding sessions
	clusterMachines = 1500 // the join storm
	clusterEvery    = 25 * time.Millisecond
	// sessionsBack is how long after a kill every session must be back:
	// bcd draws its first reconnect from [0, 10 s) (run.FirstReconnectSpread)
	// so a fleet does not come back at once, and a reconnect that lands on
	// the killed replica through a gateway waits its 1 s backoff; 20 s
	// leaves room for both and the handshake on a loaded machine.
	sessionsBack = 20 * time.Second
	// errorWindow bounds how long after a kill joins may go unanswered.
	errorWindow = time.Second
)

var (
	joinedNodeRE = regexp.MustCompile(`joined as (node_[0-9a-z]+)`)
	heldRE       = regexp.MustCompile(`(?m)^bc_sessions_held (\d+)`)
)

// the production shape on one machine. Three API replicas on one
// PostgreSQL, two gateways (each with every replica in api_urls) behind a
// TCP balancer, real bcd daemons holding sessions, a join storm, and
// commands enqueued all along. One replica is killed with SIGKILL mid-storm,
// then one gateway. The test shows that the storm's unanswered attempts lay
// within a second of each kill and were all retried to success, that no
// join was lost, no use spent twice and no machine became two nodes (R4.4,
// R4.9); that every session was back within 20 s of each kill (R12.1);
// and that every command sent ended with a result or an expiry (R12.3).
func TestClusterSurvivesKills(t *testing.T) {
	if testing.Short() {
		t.Skip("3 API replicas, 2 gateways and a join storm with two kills (about a minute)")
	}
	dsn := storetest.PostgresDSN(t)
	bc, bcd := binaries(t)
	dir := t.TempDir()
	secretEnv, pins := initPKI(t, bc, dir)

	// The replicas: one config, every listener on a port the kernel picks,
	// read back from the replica's log.
	type replica struct {
		api, agent, metrics string
		p                   *proc
		op                  *client.Client // the operator API on this replica
	}
	replicas := make([]*replica, clusterReplicas)
	conf := filepath.Join(dir, "serve.toml")
	must(t, os.WriteFile(conf, []byte(`listen = "127.0.0.1:0"
[store]
driver = "postgres"
dsn = "`+dsn+`"
max_conns = 6
[pki]
dir = "`+filepath.Join(dir, "pki")+`"
[agent]
listen = "127.0.0.1:0"
cert_file = "`+filepath.Join(dir, "agent.crt")+`"
key_file = "`+filepath.Join(dir, "agent.key")+`"
[metrics]
listen = "127.0.0.1:0"
`), 0o600))
	boot, errOut, code := run(t, nil, "", bc, "bootstrap", "--config", conf, "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	b := jsonOf(t, boot)
	// The first replica migrates alone; the others start once it is up.
	for i := range replicas {
		r := &replica{p: start(t, secretEnv, bc, "serve", "--config", conf)}
		what := fmt.Sprintf("replica %d's ", i+1)
		u, err := url.Parse(logged(t, r.p, apiURLRE, what+"API listener"))
		must(t, err)
		r.api = u.Host
		r.agent = logged(t, r.p, agentAddrRE, what+"agent listener")
		r.metrics = logged(t, r.p, metricsRE, what+"metrics listener")
		replicas[i] = r
	}

	var apiURLs []string
	for _, r := range replicas {
		apiURLs = append(apiURLs, fmt.Sprintf("%q", "https://"+r.agent))
	}
	gateways := make([]*proc, clusterGateways)
	gwAddrs := make([]string, clusterGateways)
	for i := range gateways {
		conf := filepath.Join(dir, fmt.Sprintf("gateway-%d.toml", i+1))
		must(t, os.WriteFile(conf, []byte(`listen = "127.0.0.1:0"
cert_file = "`+filepath.Join(dir, "gateway.crt")+`"
key_file = "`+filepath.Join(dir, "gateway.key")+`"
api_urls = [`+strings.Join(apiURLs, ", ")+`]
api_ca_file = "`+filepath.Join(dir, "pki", "serving-ca.crt")+`"
request_timeout = "10s"
`), 0o600))
		gateways[i] = start(t, nil, bc, "gateway", "--config", conf)
		gwAddrs[i] = logged(t, gateways[i], gatewayRE, fmt.Sprintf("gateway %d's listener", i+1))
	}
	// Daemons and the storm reach the region's gateways through one
	// address, as behind a TCP load balancer; one balancer each, so the
	// daemons' tells which gateway holds how many sessions.
	daemonLB, stormLB := startBalancer(t, gwAddrs...), startBalancer(t, gwAddrs...)

	tenant := b["tenantId"].(string)
	apiKey := b["apiKey"].(string)
	e := []string{"BETTER_COMPUTE_URL=http://" + replicas[0].api, "BETTER_COMPUTE_API_KEY=" + apiKey}
	cli := jsonCLI(t, bc, e)
	site := cli("sites", "create", "cluster", "--tenant", tenant)["id"].(string)
	pool := cli("pools", "create", "cluster", "--tenant", tenant, "--site", site)["id"].(string)
	daemonToken := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(clusterDaemons))["token"].(string)
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(clusterMachines))
	stormToken, stormTokenID := tok["token"].(string), tok["id"].(string)
	var err error
	for _, r := range replicas {
		r.op, err = client.New(client.Config{URL: "http://" + r.api, APIKey: apiKey})
		must(t, err)
	}
	// ops are the operator APIs of the replicas alive.
	ops := []*client.Client{replicas[0].op, replicas[1].op, replicas[2].op}

	// The daemons: each a fake machine that joins, then holds its session.
	sb := newStormBCD(t, dir, "https://"+daemonLB.addr, site, pins)
	bcdConf := sb.Conf
	var nodes []string
	for i := range clusterDaemons {
		sys, data := filepath.Join(dir, fmt.Sprintf("sys-%d", i)), filepath.Join(dir, fmt.Sprintf("data-%d", i))
		fakeSysfs(t, sys, fmt.Sprintf("CL-%04d", i), fmt.Sprintf("c1a57e00-0000-4000-8000-%012d", i), fmt.Sprintf("3c:ec:ef:00:10:%02x", i))
		out, errOut, code := run(t, nil, daemonToken+"\n", bcd, "join", "--config", bcdConf, "--data-dir", data, "--sysfs-root", sys)
		if code != 0 {
			t.Fatalf("bcd join %d: %s\n%s", i, out, errOut)
		}
		id := joinedNodeRE.FindStringSubmatch(out + errOut)
		if id == nil {
			t.Fatalf("bcd join %d printed no node id:\n%s%s", i, out, errOut)
		}
		nodes = append(nodes, id[1])
		start(t, nil, bcd, "run", "--config", bcdConf, "--data-dir", data)
	}
	raw, err := sql.Open("pgx", dsn)
	must(t, err)
	defer raw.Close()
	waitFor(t, "every daemon's session", 30*time.Second, func() bool {
		var n int
		return raw.QueryRow("SELECT COUNT(*) FROM nodes WHERE connection = 'connected'").Scan(&n) == nil && n == clusterDaemons
	})

	// probe shows every session is live: a command enqueued now, to each
	// node, answered by its daemon within the deadline.
	probe := func(what string, deadline time.Time) {
		t.Helper()
		ctx, cancel := context.WithDeadline(context.Background(), deadline)
		defer cancel()
		var wg sync.WaitGroup
		for i, node := range nodes {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := ops[i%len(ops)]
				for ctx.Err() == nil {
					cmd, err := c.Commands.EnqueueCommand(ctx, connect.NewRequest(&bcv1.EnqueueCommandRequest{TenantId: tenant, NodeId: node, Kind: "node.facts", TtlSeconds: 30}))
					if err != nil {
						time.Sleep(100 * time.Millisecond)
						continue
					}
					if state := waitCommand(ctx, c, tenant, cmd.Msg.GetId()); state == "done" {
						return
					}
				}
				t.Errorf("%s: node %s answered no command within %v", what, node, time.Until(deadline)+sessionsBack)
			}()
		}
		wg.Wait()
	}
	probe("before the kills", time.Now().Add(30*time.Second))
	// held reads how many sessions each replica holds (bc_sessions_held).
	held := func() []int {
		out := make([]int, len(replicas))
		for i, r := range replicas {
			out[i] = -1
			res, err := http.Get("http://" + r.metrics + "/metrics")
			if err != nil {
				continue
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if m := heldRE.FindSubmatch(b); m != nil {
				out[i], _ = strconv.Atoi(string(m[1]))
			}
		}
		return out
	}
	var victim int
	waitFor(t, "every session counted by a replica", 10*time.Second, func() bool {
		h, sum := held(), 0
		for i, n := range h {
			sum += n
			if n > h[victim] {
				victim = i
			}
		}
		return sum == clusterDaemons
	})
	t.Logf("sessions held by the replicas: %v", held())

	// Commands all along: one every 200 ms, to the nodes in turn, through
	// the two operator replicas in turn; every one must end.
	var cmdMu sync.Mutex
	var cmdIDs []string
	cmdCtx, stopCmds := context.WithCancel(context.Background())
	var cmdWG sync.WaitGroup
	cmdWG.Add(1)
	// The commands' loop uses the two replicas that stay alive.
	var survivors []*client.Client
	for i, r := range replicas {
		if i != victim {
			survivors = append(survivors, r.op)
		}
	}
	go func() {
		defer cmdWG.Done()
		for i := 0; cmdCtx.Err() == nil; i++ {
			cmd, err := survivors[i%len(survivors)].Commands.EnqueueCommand(cmdCtx, connect.NewRequest(&bcv1.EnqueueCommandRequest{
				TenantId: tenant, NodeId: nodes[i%len(nodes)], Kind: "node.facts", TtlSeconds: 20}))
			if err == nil {
				cmdMu.Lock()
				cmdIDs = append(cmdIDs, cmd.Msg.GetId())
				cmdMu.Unlock()
			} else if cmdCtx.Err() == nil {
				t.Errorf("enqueue through a live replica: %v", err)
			}
			select {
			case <-cmdCtx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()

	// The storm, paced so that both kills land in it.
	bcfg, encKey, tlsConf := sb.Config, sb.EncKey, sb.TLS
	ms := make([]*stormMachine, clusterMachines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, stormToken, encKey)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	storm := startStorm(ctx, t, stormConfig{URL: "https://" + stormLB.addr, TLS: tlsConf, SigningPin: bcfg.JoinSigningKeyPin, Site: site,
		Machines: ms, Concurrency: 16, Every: clusterEvery})

	var kills []time.Time
	waitFor(t, "a fifth of the storm", time.Minute, func() bool { return storm.confirmed.Load() >= clusterMachines/5 })
	// Kill the replica that holds the most sessions (at least 2 of 6).
	kills = append(kills, time.Now())
	must(t, replicas[victim].p.cmd.Process.Kill())
	<-replicas[victim].p.done
	ops = survivors
	t.Logf("killed replica %d (SIGKILL) after %d confirmed joins, %v into the storm", victim+1, storm.confirmed.Load(), time.Since(began).Round(time.Millisecond))
	probe("after the replica's kill", kills[0].Add(sessionsBack))
	t.Logf("every session answered %v after the replica's kill", time.Since(kills[0]).Round(time.Millisecond))

	if storm.confirmed.Load() >= clusterMachines {
		t.Fatal("the storm ended before the gateway's kill: pace it slower (clusterEvery)")
	}
	// Kill the gateway that holds the most sessions (at least 3 of 6).
	gwVictim, onIt := daemonLB.busiest()
	kills = append(kills, time.Now())
	must(t, gateways[gwVictim].cmd.Process.Kill())
	<-gateways[gwVictim].done
	t.Logf("killed gateway %d (SIGKILL), which held %d sessions, after %d confirmed joins, %v into the storm", gwVictim+1, onIt, storm.confirmed.Load(), time.Since(began).Round(time.Millisecond))
	probe("after the gateway's kill", kills[1].Add(sessionsBack))
	t.Logf("every session answered %v after the gateway's kill", time.Since(kills[1]).Round(time.Millisecond))
	waitFor(t, "the live replicas to hold every session", sessionsBack, func() bool {
		h, sum := held(), 0
		for i, n := range h {
			if i != victim {
				sum += n
			}
		}
		return sum == clusterDaemons
	})

	storm.wait()
	if ctx.Err() != nil {
		t.Fatalf("the storm did not finish: %d of %d confirmed", storm.confirmed.Load(), clusterMachines)
	}
	stopCmds()
	cmdWG.Wait()
	refused, ambiguous := stormCounts(ms)
	failures := storm.failed()
	t.Logf("storm: %d machines in %v, %d confirmed, %d refused, %d retried after an unanswered attempt (%d attempts)",
		len(ms), time.Since(began).Round(time.Millisecond), storm.confirmed.Load(), refused, ambiguous, len(failures))

	// Unanswered attempts happened only right after a kill.
	for _, f := range failures {
		var last time.Time
		for _, k := range kills {
			if !k.After(f) {
				last = k
			}
		}
		if last.IsZero() || f.Sub(last) > errorWindow {
			t.Errorf("a join went unanswered at %v, %v after the last kill (want within %v)", f.Format(time.StampMilli), f.Sub(last), errorWindow)
		}
	}

	// Every command sent ended: a result, a failure the node reported, or
	// an expiry (ttl 20 s): none is left queued or sent.
	cmdMu.Lock()
	ids := append([]string(nil), cmdIDs...)
	cmdMu.Unlock()
	states := map[string]int{}
	endCtx, endCancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer endCancel()
	for _, id := range ids {
		states[waitCommand(endCtx, survivors[0], tenant, id)]++
	}
	t.Logf("%d commands enqueued during the storm: %v", len(ids), states)
	for state, n := range states {
		if state != "done" && state != "failed" && state != "expired" {
			t.Errorf("%d commands still %q: not ended", n, state)
		}
	}
	if len(ids) == 0 {
		t.Error("no command was enqueued during the storm")
	}

	for i, r := range replicas {
		if i == victim {
			continue
		}
		must(t, r.p.cmd.Process.Signal(os.Interrupt))
		<-r.p.done
	}
	checkStormInvariants(t, store.Config{Driver: "postgres", DSN: dsn, MaxConns: 2}, tenant, stormTokenID, ms, clusterDaemons)
}

// waitCommand polls a command until it ended (done, failed, expired) or
// ctx ends, and returns its last state.
func waitCommand(ctx context.Context, c *client.Client, tenant, id string) string {
	state := "unknown"
	for {
		res, err := c.Commands.GetCommand(ctx, connect.NewRequest(&bcv1.GetCommandRequest{TenantId: tenant, CommandId: id}))
		if err == nil {
			state = res.Msg.GetState()
			if state == "done" || state == "failed" || state == "expired" {
				return state
			}
		}
		select {
		case <-ctx.Done():
			return state
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// balancer is a TCP load balancer in front of backends, as a region puts
// in front of its gateways: each connection goes to the next backend in
// turn, skipping one that refuses it.
type balancer struct {
	addr     string
	backends []string
	next     atomic.Uint32

	mu     sync.Mutex
	open   map[net.Conn]struct{} // nil once closed
	active map[string]int        // backend -> connections spliced to it now
}

// startBalancer starts a balancer on loopback.
func startBalancer(t *testing.T, backends ...string) *balancer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	b := &balancer{addr: ln.Addr().String(), backends: backends, open: map[net.Conn]struct{}{}, active: map[string]int{}}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go b.serve(c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		b.mu.Lock()
		conns := b.open
		b.open = nil
		b.mu.Unlock()
		for c := range conns {
			c.Close()
		}
	})
	return b
}

func (b *balancer) serve(c net.Conn) {
	defer c.Close()
	first := int(b.next.Add(1))
	for i := range b.backends {
		backend := b.backends[(first+i)%len(b.backends)]
		up, err := net.DialTimeout("tcp", backend, time.Second)
		if err != nil {
			continue
		}
		defer up.Close()
		b.mu.Lock()
		if b.open == nil {
			b.mu.Unlock()
			return
		}
		b.open[c], b.open[up] = struct{}{}, struct{}{}
		b.active[backend]++
		b.mu.Unlock()
		done := make(chan struct{}, 2)
		go func() { _, _ = io.Copy(up, c); done <- struct{}{} }()
		go func() { _, _ = io.Copy(c, up); done <- struct{}{} }()
		<-done
		b.mu.Lock()
		if b.open != nil {
			delete(b.open, c)
			delete(b.open, up)
		}
		b.active[backend]--
		b.mu.Unlock()
		return
	}
}

// busiest returns the index of the backend with the most connections
// spliced now, and their number.
func (b *balancer) busiest() (int, int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	best, n := 0, -1
	for i, be := range b.backends {
		if b.active[be] > n {
			best, n = i, b.active[be]
		}
	}
	return best, n
}
