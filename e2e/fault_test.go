package e2e

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// faultProxy is a TCP proxy in front of one backend that can fail the way
// networks and servers do: drop every connection and refuse new ones (a
// database restarting), or stop forwarding while holding the bytes (a
// stalled process or path).
type faultProxy struct {
	addr, backend string

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]struct{}
	gate  chan struct{} // closed while forwarding; open (blocking) while stalled
	done  bool
}

func startFaultProxy(t *testing.T, backend string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	p := &faultProxy{addr: ln.Addr().String(), backend: backend, conns: map[net.Conn]struct{}{}, gate: make(chan struct{})}
	close(p.gate)
	p.serve(ln)
	t.Cleanup(func() {
		p.mu.Lock()
		p.done = true
		p.mu.Unlock()
		p.down()
		p.resume()
	})
	return p
}

func (p *faultProxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go p.splice(c)
		}
	}()
}

func (p *faultProxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *faultProxy) splice(c net.Conn) {
	defer c.Close()
	up, err := net.DialTimeout("tcp", p.backend, 5*time.Second)
	if err != nil {
		return
	}
	defer up.Close()
	if !p.track(c, up) {
		return
	}
	done := make(chan struct{}, 2)
	go func() { p.copy(up, c); done <- struct{}{} }()
	go func() { p.copy(c, up); done <- struct{}{} }()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// copy forwards src to dst, holding what it read while the proxy stalls.
func (p *faultProxy) copy(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			gate := p.gate
			p.mu.Unlock()
			<-gate
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				if tc, ok := dst.(*net.TCPConn); ok {
					_ = tc.CloseWrite()
				}
			}
			return
		}
	}
}

// down closes every proxied connection and the listener: new connections
// are refused until up.
func (p *faultProxy) down() {
	p.mu.Lock()
	ln, conns := p.ln, p.conns
	p.ln, p.conns = nil, map[net.Conn]struct{}{}
	p.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	for c := range conns {
		c.Close()
	}
}

// up listens again on the same address.
func (p *faultProxy) up(t *testing.T) {
	t.Helper()
	var ln net.Listener
	waitFor(t, "the proxy's address to be free again", 10*time.Second, func() bool {
		var err error
		ln, err = net.Listen("tcp", p.addr)
		return err == nil
	})
	p.serve(ln)
}

// stall stops forwarding: bytes read are held, connections stay open.
func (p *faultProxy) stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.gate:
		p.gate = make(chan struct{})
	default:
	}
}

// resume forwards again, the held bytes first.
func (p *faultProxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.gate:
	default:
		close(p.gate)
	}
}

// faultPostgresDSN is storetest.PostgresDSN, but in CI (CI=true) a missing
// database fails the test instead of skipping it: these tests are the only
// ones that show a PostgreSQL outage costs no machine.
func faultPostgresDSN(t *testing.T) string {
	t.Helper()
	if os.Getenv(storetest.PostgresEnv) == "" && tools.InCI() {
		t.Fatalf("%s is not set: CI must run the PostgreSQL fault tests", storetest.PostgresEnv)
	}
	return storetest.PostgresDSN(t)
}

// viaProxy returns dsn with its host replaced by addr.
func viaProxy(t *testing.T, dsn, addr string) (proxied, backend string) {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil || u.Host == "" {
		t.Fatalf("the fault tests need a postgres:// URL DSN, not %q", dsn)
	}
	backend = u.Host
	if u.Port() == "" {
		backend = net.JoinHostPort(u.Hostname(), "5432")
	}
	u.Host = addr
	return u.String(), backend
}

// codeOf is the product code of an operator call's error (INTERNAL also when
// only Connect's code says so).
func codeOf(err error) errs.Code {
	var e *errs.E
	if errors.As(err, &e) {
		return e.Code
	}
	if connect.CodeOf(err) == connect.CodeInternal {
		return errs.Internal
	}
	return errs.CodeOf(wire.FromWire(err))
}

// apiReplica is one API replica on a shared PostgreSQL database: its
// config, its bound addresses and its process.
type apiReplica struct {
	conf, api, agent string
	p                *proc
}

// startReplicas writes the configs of n API replicas on the PostgreSQL
// database dsn, bootstraps through bootDSN and starts them.
func startReplicas(t *testing.T, bc, dir string, secretEnv []string, dsn, bootDSN string, n int, extra string) ([]*apiReplica, map[string]any) {
	t.Helper()
	rs := make([]*apiReplica, n)
	write := func(r *apiReplica, dsn string) {
		must(t, os.WriteFile(r.conf, []byte(`listen = "`+r.api+`"
[store]
driver = "postgres"
dsn = "`+dsn+`"
max_conns = 6
[pki]
dir = "`+filepath.Join(dir, "pki")+`"
[agent]
listen = "`+r.agent+`"
cert_file = "`+filepath.Join(dir, "agent.crt")+`"
key_file = "`+filepath.Join(dir, "agent.key")+`"
`+extra), 0o600))
	}
	for i := range rs {
		rs[i] = &apiReplica{conf: filepath.Join(dir, fmt.Sprintf("serve-%d.toml", i+1)), api: "127.0.0.1:0", agent: "127.0.0.1:0"}
	}
	// Bootstrap straight to the database, then point the replicas at dsn.
	write(rs[0], bootDSN)
	boot, errOut, code := run(t, nil, "", bc, "bootstrap", "--config", rs[0].conf, "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	// Each replica binds port 0 and keeps the ports it was given in its
	// config, for a restart.
	for i, r := range rs {
		write(r, dsn)
		r.p = start(t, secretEnv, bc, "serve", "--config", r.conf)
		u, err := url.Parse(logged(t, r.p, apiURLRE, fmt.Sprintf("replica %d's API listener", i+1)))
		must(t, err)
		r.api, r.agent = u.Host, logged(t, r.p, agentAddrRE, fmt.Sprintf("replica %d's agent listener", i+1))
		write(r, dsn)
	}
	return rs, jsonOf(t, boot)
}

func startGateway(t *testing.T, bc, dir, name string, apiURLs []string, extra string) string {
	t.Helper()
	var quoted []string
	for _, u := range apiURLs {
		quoted = append(quoted, fmt.Sprintf("%q", u))
	}
	conf := filepath.Join(dir, name+".toml")
	must(t, os.WriteFile(conf, []byte(`listen = "127.0.0.1:0"
cert_file = "`+filepath.Join(dir, "gateway.crt")+`"
key_file = "`+filepath.Join(dir, "gateway.key")+`"
api_urls = [`+strings.Join(quoted, ", ")+`]
api_ca_file = "`+filepath.Join(dir, "pki", "serving-ca.crt")+`"
`+extra), 0o600))
	return logged(t, start(t, nil, bc, "gateway", "--config", conf), gatewayRE, name)
}

// PostgreSQL restarts in the middle of a join storm through a gateway and
// two API replicas: a proxy between the replicas and the database drops
// every connection and refuses new ones for a few seconds, as a restart
// does. Machines resend a request only when the answer says it may be
// retried (UNAVAILABLE, or no answer); nobody may see INTERNAL. Every
// machine joins, once: one node each, uses spent == machines, each told
// the node the database has. Operator calls during the outage answer
// UNAVAILABLE, not INTERNAL. R19.1, R4.9
func TestPostgresRestartDuringJoinStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("a PostgreSQL outage during a join storm through 2 replicas (about 40 s)")
	}
	const machines = 300
	dsn := faultPostgresDSN(t)
	bc, _ := binaries(t)
	dir := t.TempDir()
	secretEnv, pins := initPKI(t, bc, dir)
	_, backend := viaProxy(t, dsn, "127.0.0.1:1")
	pg := startFaultProxy(t, backend)
	proxied, _ := viaProxy(t, dsn, pg.addr)
	rs, b := startReplicas(t, bc, dir, secretEnv, proxied, dsn, 2, "")
	gw := startGateway(t, bc, dir, "gateway", []string{"https://" + rs[0].agent, "https://" + rs[1].agent}, "request_timeout = \"10s\"\n")

	tenant, apiKey := b["tenantId"].(string), b["apiKey"].(string)
	cli := jsonCLI(t, bc, []string{"BETTER_COMPUTE_URL=http://" + rs[0].api, "BETTER_COMPUTE_API_KEY=" + apiKey})
	site := cli("sites", "create", "pg-restart", "--tenant", tenant)["id"].(string)
	pool := cli("pools", "create", "pg-restart", "--tenant", tenant, "--site", site)["id"].(string)
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(machines))
	op, err := client.New(client.Config{URL: "http://" + rs[1].api, APIKey: apiKey})
	must(t, err)

	sb := newStormBCD(t, dir, "https://"+gw, site, pins)
	ms := make([]*stormMachine, machines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, tok["token"].(string), sb.EncKey)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	storm := startStorm(ctx, t, stormConfig{URL: "https://" + gw, TLS: sb.TLS, SigningPin: sb.Config.JoinSigningKeyPin, Site: site,
		Machines: ms, Concurrency: 16, Every: 30 * time.Millisecond, OnlyRetryable: true})

	waitFor(t, "a third of the storm", time.Minute, func() bool { return storm.confirmed.Load() >= machines/3 })
	pg.down()
	downAt := time.Now()
	t.Logf("PostgreSQL down (every connection dropped, new ones refused) after %d confirmed joins, %v into the storm", storm.confirmed.Load(), downAt.Sub(began).Round(time.Millisecond))
	// The operator during the outage: a read and a write, both answered
	// UNAVAILABLE (the write after its outage_wait), never INTERNAL.
	callCtx, callCancel := context.WithTimeout(context.Background(), 30*time.Second)
	_, lerr := op.Nodes.ListNodes(callCtx, connect.NewRequest(&bcv1.ListNodesRequest{TenantId: tenant}))
	_, cerr := op.JoinTokens.CreateJoinToken(callCtx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool, TtlSeconds: 600, MaxUses: 1}))
	callCancel()
	for what, err := range map[string]error{"nodes list": lerr, "join-tokens create": cerr} {
		if err == nil {
			t.Errorf("%s during the outage succeeded: the proxy did not cut the database off", what)
		} else if c := codeOf(err); c != errs.Unavailable {
			t.Errorf("%s during the outage: %v (code %s), want UNAVAILABLE", what, err, c)
		} else {
			t.Logf("%s during the outage: %v", what, err)
		}
	}
	// A restart of some seconds: longer than the store's outage_wait, so
	// joins see UNAVAILABLE and retry, not only wait.
	if d := 5*time.Second - time.Since(downAt); d > 0 {
		time.Sleep(d)
	}
	confirmedAtUp := storm.confirmed.Load()
	pg.up(t)
	t.Logf("PostgreSQL back after %v; %d confirmed meanwhile", time.Since(downAt).Round(time.Millisecond), confirmedAtUp)

	storm.wait()
	if ctx.Err() != nil {
		t.Fatalf("the storm did not finish: %d of %d confirmed", storm.confirmed.Load(), machines)
	}
	refused, ambiguous := stormCounts(ms)
	codes := storm.errorCodes()
	t.Logf("storm: %d machines in %v, %d confirmed, %d refused, %d retried; errors by code %v",
		machines, time.Since(began).Round(time.Millisecond), storm.confirmed.Load(), refused, ambiguous, codes)
	if codes[errs.Internal] != 0 {
		t.Errorf("%d INTERNAL answers during the storm", codes[errs.Internal])
	}
	if codes[errs.Unavailable] == 0 {
		t.Error("no join saw UNAVAILABLE: the outage did not reach the storm")
	}
	for _, r := range rs {
		must(t, r.p.cmd.Process.Signal(os.Interrupt))
		<-r.p.done
	}
	checkStormInvariants(t, store.Config{Driver: "postgres", DSN: dsn, MaxConns: 2}, tenant, tok["id"].(string), ms, 0)
}

// joinOnce sends m's join through client once and verifies a success as
// bcd does; it returns the product code of a failure ("" on success).
func joinOnce(ctx context.Context, t *testing.T, c agentv1connect.JoinServiceClient, m *stormMachine, pin, site string) errs.Code {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := c.Join(ctx, connect.NewRequest(m.req))
	if err != nil {
		c := codeOf(err)
		m.lastErr = err.Error()
		if c != errs.AccessDenied {
			m.ambiguous = true
		}
		return c
	}
	sum := sha256.Sum256(m.csr)
	body, err := enroll.VerifyResponse(res.Msg, enroll.Expectation{SigningPin: pin, CSRHash: sum[:], NodeKey: m.key.Public(), SiteID: site, Role: pki.RoleNode})
	if err != nil {
		t.Fatalf("machine %s: answer fails bcd's checks: %v", m.host, err)
	}
	m.nodeID = body.GetNodeId()
	return ""
}

// readyz returns the status and body of url's /readyz.
func readyz(url string) (int, string) {
	res, err := http.Get(url + "/readyz")
	if err != nil {
		return 0, err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, strings.TrimSpace(string(b))
}

// fillDisk writes path until its file system is full.
func fillDisk(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Create(path)
	must(t, err)
	defer f.Close()
	buf := make([]byte, 64<<10)
	var n int64
	for {
		w, err := f.Write(buf)
		n += int64(w)
		if err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill %s: %v", path, err)
			}
			break
		}
	}
	// The last bytes a page at a time, so no block is left free.
	for {
		if _, err := f.Write(buf[:512]); err != nil {
			break
		}
		n += 512
	}
	_ = f.Sync()
	return n
}

// SQLite's file system fills up under `better-compute serve`: a small
// tmpfs holds the database, and a file takes every free byte. /readyz
// turns 503 naming the reason, and joins answer UNAVAILABLE (never
// INTERNAL) while token creation answers or says UNAVAILABLE; once the
// file is gone /readyz is 200 again without a restart, every machine
// refused for space joins by resending the same request, and the
// database is intact with one node per machine and the uses spent. R19.1
func TestSQLiteDiskFullReadyz(t *testing.T) {
	if testing.Short() {
		t.Skip("fills a tmpfs under serve (about 30 s)")
	}
	const machines = 60
	dir := t.TempDir()
	disk := filepath.Join(dir, "disk")
	must(t, os.MkdirAll(disk, 0o700))
	// A real full file system: a tmpfs of its own (CI runs as root, and
	// mounts it).
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", disk).CombinedOutput(); err != nil {
		why := "a full file system under serve needs a tmpfs of its own: root or CAP_SYS_ADMIN"
		tools.Missing(t, fmt.Sprintf("cannot mount a tmpfs: %v %s", err, out), why)
		t.Skipf("SKIPPING: cannot mount a tmpfs to fill (%s; CI=true makes this a failure): %v %s", why, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "-l", disk).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v %s", disk, err, out)
		}
	})
	dbPath := filepath.Join(disk, "bc.db")
	st := startStack(t, stackOpts{Store: fmt.Sprintf("path = %q", dbPath), GatewayTOML: `request_timeout = "10s"`})
	apiURL, tenant, apiKey, gw, pins, cli := st.apiURL, st.tenant, st.apiKey, st.gw, st.pins, st.cli
	site, pool := st.sitePool("full")
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(machines))
	op, err := client.New(client.Config{URL: apiURL, APIKey: apiKey})
	must(t, err)

	sb := newStormBCD(t, st.dir, "https://"+gw, site, pins)
	ms := make([]*stormMachine, machines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, tok["token"].(string), sb.EncKey)
	}
	tr := &http.Transport{TLSClientConfig: sb.TLS.Clone(), ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	jc := agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, "https://"+gw, connect.WithGRPC())
	ctx := context.Background()
	pin := sb.Config.JoinSigningKeyPin
	next := 0
	for ; next < 5; next++ {
		if c := joinOnce(ctx, t, jc, ms[next], pin, site); c != "" {
			t.Fatalf("join before the disk is full: %s", ms[next].lastErr)
		}
	}
	if st, body := readyz(apiURL); st != http.StatusOK {
		t.Fatalf("/readyz before the disk is full: %d %s", st, body)
	}

	fill := filepath.Join(disk, "fill")
	t.Logf("filled the disk with %d MiB", fillDisk(t, fill)>>20)
	// Machines keep joining: each is answered, or told UNAVAILABLE, until
	// a write fails for space and /readyz says so.
	var unavailable int
	var body, refusal string
	for {
		if next == machines {
			t.Fatalf("%d joins and the disk never refused one (/readyz: %s)", machines, body)
		}
		switch c := joinOnce(ctx, t, jc, ms[next], pin, site); c {
		case "":
		case errs.Unavailable:
			unavailable++
			refusal = ms[next].lastErr
		default:
			t.Errorf("join on a full disk: %s (want success or UNAVAILABLE)", ms[next].lastErr)
		}
		next++
		var st int
		if st, body = readyz(apiURL); unavailable > 0 && st == http.StatusServiceUnavailable && strings.Contains(body, "out of space") {
			break
		}
	}
	t.Logf("the disk refused: %d of %d joins since it filled answered UNAVAILABLE (%s); /readyz: 503 %s", unavailable, next-5, refusal, body)
	if _, err := op.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool, TtlSeconds: 600, MaxUses: 1})); err != nil && codeOf(err) != errs.Unavailable {
		t.Errorf("join-tokens create on a full disk: %v (want success or UNAVAILABLE)", err)
	}
	// One more machine on the full disk: refused for space, not INTERNAL.
	if c := joinOnce(ctx, t, jc, ms[next], pin, site); c != "" && c != errs.Unavailable {
		t.Errorf("join on a full disk: %s (want UNAVAILABLE)", ms[next].lastErr)
	}
	next++

	must(t, os.Remove(fill))
	waitFor(t, "/readyz 200 after the disk has room again", time.Minute, func() bool {
		st, _ := readyz(apiURL)
		return st == http.StatusOK
	})
	// Every machine joins now: those refused for space resend the same
	// request, the others join for the first time.
	deadline := time.Now().Add(time.Minute)
	for i, m := range ms {
		for m.nodeID == "" {
			c := joinOnce(ctx, t, jc, m, pin, site)
			if c != "" && c != errs.Unavailable {
				t.Fatalf("machine %d after the disk has room: %s", i, m.lastErr)
			}
			if c != "" && time.Now().After(deadline) {
				t.Fatalf("machine %d still refused a minute after the disk has room: %s", i, m.lastErr)
			}
			if c != "" {
				time.Sleep(100 * time.Millisecond)
			}
		}
	}
	must(t, st.serve.cmd.Process.Signal(os.Interrupt))
	<-st.serve.done
	raw, err := sql.Open("sqlite", "file:"+dbPath)
	must(t, err)
	var integrity string
	must(t, raw.QueryRow("PRAGMA integrity_check").Scan(&integrity))
	raw.Close()
	if integrity != "ok" {
		t.Errorf("SQLite after the full disk: integrity_check %q", integrity)
	}
	checkStormInvariants(t, store.Config{Driver: "sqlite", Path: dbPath}, tenant, tok["id"].(string), ms, 0)
}

// checkNoFailureAfterCommit fails the test for every machine of ms told
// an error after its node's join had begun in the database (created_ms):
// that machine was told it failed for a join that committed.
func checkNoFailureAfterCommit(t *testing.T, dsn, tokenID string, ms []*stormMachine) {
	t.Helper()
	raw, err := sql.Open("pgx", dsn)
	must(t, err)
	defer raw.Close()
	rows, err := raw.Query("SELECT hostname, created_ms FROM nodes WHERE join_token_id = $1", tokenID)
	must(t, err)
	created := map[string]int64{}
	for rows.Next() {
		var h string
		var ms int64
		must(t, rows.Scan(&h, &ms))
		created[h] = ms
	}
	must(t, rows.Err())
	rows.Close()
	for _, m := range ms {
		c, ok := created[m.host]
		if !ok {
			continue
		}
		for _, at := range m.errAt {
			if at.UnixMilli() > c {
				t.Errorf("machine %s was told %q at %s, after its node was made at %s", m.host, m.lastErr,
					at.Format(time.StampMilli), time.UnixMilli(c).Format(time.StampMilli))
			}
		}
	}
}

// One of two API replicas stalls mid-storm: a proxy in front of its
// agent listener stops forwarding (holding the bytes, connections open)
// for 20 s. The gateway (attempt_timeout 1 s) resends joins in flight on
// it to the other replica and takes it out; every machine joins once
// (one node each, uses spent == machines, each told the node the
// database has), nobody sees INTERNAL, and no machine is told an error
// after its join committed, though the stalled replica processes the
// held copies once it resumes. R19.2, R4.9
func TestStalledReplicaDuringJoinStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica stalled for 20 s during a join storm (about 45 s)")
	}
	const (
		machines = 800
		stallFor = 20 * time.Second
	)
	dsn := faultPostgresDSN(t)
	bc, _ := binaries(t)
	dir := t.TempDir()
	secretEnv, pins := initPKI(t, bc, dir)
	rs, b := startReplicas(t, bc, dir, secretEnv, dsn, dsn, 2, "")
	stalled := startFaultProxy(t, rs[0].agent)
	gwConf := filepath.Join(dir, "gateway.toml")
	must(t, os.WriteFile(gwConf, []byte(`listen = "127.0.0.1:0"
cert_file = "`+filepath.Join(dir, "gateway.crt")+`"
key_file = "`+filepath.Join(dir, "gateway.key")+`"
api_urls = ["https://`+stalled.addr+`", "https://`+rs[1].agent+`"]
api_ca_file = "`+filepath.Join(dir, "pki", "serving-ca.crt")+`"
request_timeout = "15s"
attempt_timeout = "1s"
`), 0o600))
	gateway := start(t, nil, bc, "gateway", "--config", gwConf)
	gw := "https://" + logged(t, gateway, gatewayRE, "gateway")

	tenant, apiKey := b["tenantId"].(string), b["apiKey"].(string)
	cli := jsonCLI(t, bc, []string{"BETTER_COMPUTE_URL=http://" + rs[1].api, "BETTER_COMPUTE_API_KEY=" + apiKey})
	site := cli("sites", "create", "stall", "--tenant", tenant)["id"].(string)
	pool := cli("pools", "create", "stall", "--tenant", tenant, "--site", site)["id"].(string)
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(machines))

	sb := newStormBCD(t, dir, gw, site, pins)
	ms := make([]*stormMachine, machines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, tok["token"].(string), sb.EncKey)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	storm := startStorm(ctx, t, stormConfig{URL: gw, TLS: sb.TLS, SigningPin: sb.Config.JoinSigningKeyPin, Site: site,
		Machines: ms, Concurrency: 16, Every: 25 * time.Millisecond, OnlyRetryable: true})

	waitFor(t, "a fifth of the storm", time.Minute, func() bool { return storm.confirmed.Load() >= machines/5 })
	stalled.stall()
	stalledAt := time.Now()
	t.Logf("replica 1 stalled after %d confirmed joins, %v into the storm", storm.confirmed.Load(), stalledAt.Sub(began).Round(time.Millisecond))
	waitFor(t, "the gateway to take the stalled replica out", 30*time.Second, func() bool {
		return strings.Contains(gateway.output(), `"API replica out" api_url=https://`+stalled.addr)
	})
	t.Logf("the gateway took it out %v after the stall", time.Since(stalledAt).Round(time.Millisecond))
	if d := stallFor - time.Since(stalledAt); d > 0 {
		time.Sleep(d)
	}
	confirmedAtResume := storm.confirmed.Load()
	stalled.resume()
	t.Logf("replica 1 forwarding again after %v; %d confirmed meanwhile", time.Since(stalledAt).Round(time.Millisecond), confirmedAtResume)
	waitFor(t, "the gateway to take the replica back", 30*time.Second, func() bool {
		return strings.Contains(gateway.output(), `"API replica back" api_url=https://`+stalled.addr)
	})

	storm.wait()
	if ctx.Err() != nil {
		t.Fatalf("the storm did not finish: %d of %d confirmed", storm.confirmed.Load(), machines)
	}
	refused, ambiguous := stormCounts(ms)
	resent := strings.Count(gateway.output(), "relay resent to another API replica")
	t.Logf("storm: %d machines in %v, %d confirmed, %d refused, %d retried by the machine; errors by code %v; the gateway resent %d (log lines, rate-limited)",
		machines, time.Since(began).Round(time.Millisecond), storm.confirmed.Load(), refused, ambiguous, storm.errorCodes(), resent)
	if n := storm.errorCodes()[errs.Internal]; n != 0 {
		t.Errorf("%d INTERNAL answers during the storm", n)
	}
	checkNoFailureAfterCommit(t, dsn, tok["id"].(string), ms)
	for _, r := range rs {
		must(t, r.p.cmd.Process.Signal(os.Interrupt))
		<-r.p.done
	}
	checkStormInvariants(t, store.Config{Driver: "postgres", DSN: dsn, MaxConns: 2}, tenant, tok["id"].(string), ms, 0)
}
