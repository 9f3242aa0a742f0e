package e2e

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// docs/operations/upgrade.md, "Rolling upgrades: expand, then contract": a rolling upgrade rehearsed with real processes on one
// PostgreSQL. Replica A runs the release before the newest migration (built
// from the git history), B the binary under test; machines join through
// gateways the whole time:
//
//  1. A (old) alone migrates the database to N-1 and serves;
//  2. B (new) starts beside it and migrates to N while A serves; both
//     serve joins and both run their controllers, old and new, on one
//     work queue. Joins reach A through gw-a, which names only A (the
//     deployment's gateway before it had replicas), and B through gw-ab,
//     which names both: gw-ab keeps out a replica whose agent listener
//     does not answer GET /readyz, and releases before api_urls do not;
//  3. A stops (SIGTERM): joins go on through B;
//  4. A starts again on the new binary at the same address, and the rest
//     of the machines join through both.
//
// Afterwards: every machine was confirmed (answers verified as bcd does;
// only non-answers were retried), nothing was refused, uses spent = nodes,
// the database is whole (checkStormInvariants), every node, whichever
// binary admitted it and whichever controller took it, is adopted, and no
// process logged an error. R4.4, R4.9, R12.2
func TestRollingUpgrade(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the previous release and runs a rolling upgrade under joins (up to two minutes)")
	}
	dsn := storetest.PostgresDSN(t)
	started := time.Now()

	// The old binary builds while the new ones do.
	oldBin := make(chan string, 1)
	oldErr := make(chan error, 1)
	oldDir := t.TempDir()
	oldRev, why := previousRelease(t)
	if oldRev == "" {
		tools.Missing(t, "no previous release to upgrade from", why)
		t.Skipf("SKIPPING: no previous release to upgrade from (%s; CI=true makes this a failure)", why)
	}
	go func() {
		p, err := buildRelease(oldRev, oldDir)
		oldBin <- p
		oldErr <- err
	}()
	bc, _ := binaries(t)
	old := <-oldBin
	if err := <-oldErr; err != nil {
		t.Fatal(err)
	}
	t.Logf("old release %s (%s), built in %s", oldRev[:12], why, time.Since(started).Round(time.Second))

	dir := t.TempDir()
	secretEnv, pins := initPKI(t, bc, dir)
	// Every listener binds port 0 and its address is read from the ready
	// line (the old release logs them too), but for B's agent listener.
	addrs := map[string]string{"a.api": "127.0.0.1:0", "a.agent": "127.0.0.1:0", "b.api": "127.0.0.1:0",
		// gw-ab names it before B starts (step 2), so it is picked ahead.
		"b.agent": freePort(t)}
	serveConf := func(name string) string {
		p := filepath.Join(dir, name+".toml")
		must(t, os.WriteFile(p, []byte(`listen = "`+addrs[name+".api"]+`"
[store]
driver = "postgres"
dsn = "`+dsn+`"
max_conns = 8
[pki]
dir = "`+filepath.Join(dir, "pki")+`"
[agent]
listen = "`+addrs[name+".agent"]+`"
cert_file = "`+filepath.Join(dir, "agent.crt")+`"
key_file = "`+filepath.Join(dir, "agent.key")+`"
`), 0o600))
		return p
	}
	confA := serveConf("a")

	// 1. The old release bootstraps (migrating to N-1) and serves alone.
	boot, errOut, code := run(t, nil, "", old, "bootstrap", "--config", confA, "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	b := jsonOf(t, boot)
	var logs []*proc
	// startServe starts replica name and keeps the addresses it bound in
	// its config, where a restart finds them.
	startServe := func(bin, name, what string) *proc {
		t.Helper()
		p := start(t, secretEnv, bin, "serve", "--config", serveConf(name))
		logs = append(logs, p)
		u, err := url.Parse(logged(t, p, apiURLRE, what))
		must(t, err)
		addrs[name+".api"], addrs[name+".agent"] = u.Host, logged(t, p, agentAddrRE, what+"'s agent listener")
		serveConf(name)
		return p
	}
	replicaA := startServe(old, "a", "replica A (old)")
	apiA := "http://" + addrs["a.api"]
	waitReady(t, apiA, "replica A (old)")

	gwConf := func(name string, apis ...string) string {
		p := filepath.Join(dir, name+".toml")
		var urls []string
		for _, a := range apis {
			urls = append(urls, fmt.Sprintf("%q", "https://"+a))
		}
		must(t, os.WriteFile(p, []byte(`listen = "127.0.0.1:0"
cert_file = "`+filepath.Join(dir, "gateway.crt")+`"
key_file = "`+filepath.Join(dir, "gateway.key")+`"
api_urls = [`+strings.Join(urls, ", ")+`]
api_ca_file = "`+filepath.Join(dir, "pki", "serving-ca.crt")+`"
request_timeout = "5s"
`), 0o600))
		return p
	}
	// The deployment's gateway names A only; the one for the replicas
	// names A and B (B's address is picked ahead: it is down until step 2).
	var gws [2]string
	for i, c := range []string{gwConf("gw-a", addrs["a.agent"]), gwConf("gw-ab", addrs["a.agent"], addrs["b.agent"])} {
		p := start(t, nil, bc, "gateway", "--config", c)
		logs = append(logs, p)
		gws[i] = "https://" + logged(t, p, gatewayRE, "a gateway listener")
	}

	e := []string{"BETTER_COMPUTE_URL=" + apiA, "BETTER_COMPUTE_API_KEY=" + b["apiKey"].(string)}
	tenant := b["tenantId"].(string)
	cli := jsonCLI(t, old, e)
	site := cli("sites", "create", "upgrade", "--tenant", tenant)["id"].(string)
	pool := cli("pools", "create", "upgrade", "--tenant", tenant, "--site", site)["id"].(string)
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(upgradeMachines))
	token, tokenID := tok["token"].(string), tok["id"].(string)

	sb := newStormBCD(t, dir, gws[1], site, pins)
	bcfg, encKey, tlsConf := sb.Config, sb.EncKey, sb.TLS
	ms := make([]*stormMachine, upgradeMachines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, token, encKey)
	}

	// The machines: each gateway has its own share (gw-a 120, gw-ab 280)
	// and takes its next machine only within its quota, which each step
	// raises (gw-a gets none while A is down). gw-ab's quota is raised
	// before each change of the replicas, so its joins are in flight
	// while B migrates and while A stops. A worker tries a machine until
	// it is told yes or no, resending the very same request after
	// anything else.
	var pools [2][]*stormMachine
	pools[0], pools[1] = ms[:upgradeMachines*3/10], ms[upgradeMachines*3/10:]
	var next, limit, done [2]atomic.Int64
	var step atomic.Int32
	var perStep [5][2]atomic.Int64 // confirmed joins by step and gateway
	ctx, cancel := context.WithTimeout(context.Background(), upgradeDeadline)
	defer cancel()
	var wg sync.WaitGroup
	for w := range upgradeWorkers {
		gw := w % 2
		wg.Go(func() {
			tr := &http.Transport{TLSClientConfig: tlsConf.Clone(), ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 1}
			defer tr.CloseIdleConnections()
			client := agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr, Timeout: 20 * time.Second}, gws[gw], connect.WithGRPC())
			for ctx.Err() == nil {
				i := next[gw].Load()
				if i >= int64(len(pools[gw])) {
					return
				}
				if i >= limit[gw].Load() || !next[gw].CompareAndSwap(i, i+1) {
					time.Sleep(5 * time.Millisecond)
					continue
				}
				m := pools[gw][i]
				for ctx.Err() == nil {
					res, err := client.Join(ctx, connect.NewRequest(m.req))
					if err == nil {
						sum := sha256.Sum256(m.csr)
						body, verr := enroll.VerifyResponse(res.Msg, enroll.Expectation{SigningPin: bcfg.JoinSigningKeyPin, CSRHash: sum[:], NodeKey: m.key.Public(), SiteID: site, Role: pki.RoleNode})
						if verr != nil {
							t.Errorf("gateway %d machine %d: answer fails bcd's checks: %v", gw, i, verr)
							break
						}
						m.nodeID = body.GetNodeId()
						perStep[step.Load()][gw].Add(1)
						break
					}
					err = wire.FromWire(err)
					if errs.Is(err, errs.AccessDenied) {
						m.refused = true
						break
					}
					m.ambiguous, m.lastErr = true, err.Error()
					time.Sleep(50 * time.Millisecond)
				}
				done[gw].Add(1)
			}
		})
	}
	// open starts step s, letting each gateway take up to quota[g] more
	// machines; until waits for cond within the test's deadline.
	open := func(s int, quota [2]int64) {
		step.Store(int32(s))
		for g := range quota {
			limit[g].Store(min(done[g].Load()+quota[g], int64(len(pools[g]))))
		}
	}
	until := func(what string, cond func() bool) {
		t.Helper()
		waitFor(t, what, time.Until(deadlineOf(ctx)), cond)
	}
	answered := func(g int) bool { return done[g].Load() >= limit[g].Load() }
	open(1, [2]int64{40, 40})
	until("step 1: 40 machines per gateway answered", func() bool { return answered(0) && answered(1) })
	// The old controller adopts on the N-1 schema.
	raw, err := sql.Open("pgx", dsn)
	must(t, err)
	defer raw.Close()
	adopted := func() (n int) {
		must(t, raw.QueryRow("SELECT COUNT(*) FROM nodes WHERE state = $1", store.NodeAdopted).Scan(&n))
		return n
	}
	until("a node adopted by the old release", func() bool { return adopted() > 0 })

	// 2. B on the new binary migrates to N while A serves.
	open(2, [2]int64{40, 100})
	startServe(bc, "b", "replica B (new)")
	waitReady(t, "http://"+addrs["b.api"], "replica B (new)")
	until("step 2: 40 joins through A (gw-a) and 30 through gw-ab", func() bool { return answered(0) && perStep[2][1].Load() >= 30 })

	// 3. A stops while joins go on through B.
	open(3, [2]int64{0, 100})
	must(t, replicaA.cmd.Process.Signal(syscall.SIGTERM))
	if code := replicaA.exited(t, 30*time.Second); code != 0 {
		t.Errorf("replica A (old) exited with %d after SIGTERM", code)
	}
	stoppedA := time.Now()
	until("step 3: 40 joins through B alone", func() bool { return perStep[3][1].Load() >= 40 })

	// 4. A comes back on the new binary; the rest join through both.
	startServe(bc, "a", "replica A (new)")
	waitReady(t, apiA, "replica A (new)")
	step.Store(4)
	limit[0].Store(int64(len(pools[0])))
	limit[1].Store(int64(len(pools[1])))
	wg.Wait()
	if ctx.Err() != nil {
		t.Fatalf("the machines did not all join within %v (%d and %d answered)", upgradeDeadline, done[0].Load(), done[1].Load())
	}
	confirmed := 0
	for _, m := range ms {
		if m.nodeID != "" {
			confirmed++
		}
	}
	var refused, ambiguous int
	var lastErrs []string
	for _, m := range ms {
		if m.refused {
			refused++
		}
		if m.ambiguous {
			ambiguous++
			lastErrs = append(lastErrs, m.lastErr)
		}
	}
	slices.Sort(lastErrs)
	lastErrs = slices.Compact(lastErrs)
	var counts []string
	for s := 1; s <= 4; s++ {
		counts = append(counts, fmt.Sprintf("step %d: %d via gw-a, %d via gw-ab", s, perStep[s][0].Load(), perStep[s][1].Load()))
	}
	t.Logf("%d machines: %d confirmed, %d refused, %d retried after a non-answer %q; %s", len(ms), confirmed, refused, ambiguous, lastErrs, strings.Join(counts, "; "))

	// Every node adopts, whichever binary admitted it and whichever
	// controller claimed it. Bounded by the old release's claim: an old
	// replica records no owner, so what it had claimed when it stopped
	// comes back only when its claim (a minute) runs out; a new replica
	// cannot tell that from an old replica still at work on it.
	var notAdopted int
	waitFor(t, "every node adopted", time.Until(stoppedA.Add(time.Minute+30*time.Second)), func() bool {
		must(t, raw.QueryRow("SELECT COUNT(*) FROM nodes WHERE state <> $1", store.NodeAdopted).Scan(&notAdopted))
		return notAdopted == 0
	})
	t.Logf("every node adopted %s after A (old) stopped", time.Since(stoppedA).Round(100*time.Millisecond))

	checkStormInvariants(t, store.Config{Driver: "postgres", DSN: dsn, MaxConns: 2}, tenant, tokenID, ms, 0)
	for _, p := range logs {
		what := fmt.Sprintf("%s %s", p.cmd.Path, strings.Join(p.cmd.Args[1:], " "))
		out := p.output()
		if lines := errorLines(out); len(lines) > 0 {
			t.Errorf("%s logged errors:\n%s", what, strings.Join(lines, "\n"))
		}
		warns := map[string]int{}
		for _, m := range warnRE.FindAllStringSubmatch(out, -1) {
			warns[m[1]]++
		}
		if len(warns) > 0 {
			t.Logf("%s warned: %v", what, warns)
		}
	}
	t.Logf("rolling upgrade rehearsed in %s", time.Since(started).Round(time.Second))
}

const (
	upgradeMachines = 400
	upgradeWorkers  = 8
	upgradeDeadline = 60 * time.Second
)

var (
	errorLineRE = regexp.MustCompile(`(?m)^.*level=ERROR.*$`)
	warnRE      = regexp.MustCompile(`level=WARN msg="([^"]*)"`)
)

// deadlineOf is ctx's deadline.
func deadlineOf(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}

func errorLines(out string) []string { return errorLineRE.FindAllString(out, -1) }

// waitReady polls an API's GET /readyz (its database answers) until 200.
func waitReady(t *testing.T, api, what string) {
	t.Helper()
	c := &http.Client{Timeout: time.Second}
	waitFor(t, what+" ready", 30*time.Second, func() bool {
		res, err := c.Get(api + "/readyz")
		if err != nil {
			return false
		}
		res.Body.Close()
		return res.StatusCode == http.StatusOK
	})
}

// previousRelease returns the commit to upgrade from: the parent of the
// commit that added the newest PostgreSQL migration (the newest release
// without it), or HEAD when that migration is not committed yet. It
// returns "" and why when the history is not there (not a git checkout, a
// shallow clone without that commit).
func previousRelease(t *testing.T) (rev, why string) {
	t.Helper()
	git := func(args ...string) (string, error) {
		out, err := exec.Command("git", append([]string{"-C", ".."}, args...)...).Output()
		return strings.TrimSpace(string(out)), err
	}
	tools.Need(t, "git", "the previous release is built from this checkout's history")
	if _, err := git("rev-parse", "--show-toplevel"); err != nil {
		return "", "not a git checkout"
	}
	migs, err := filepath.Glob(filepath.Join("..", "internal", "controlplane", "store", "migrations", "postgres", "*.sql"))
	if err != nil || len(migs) == 0 {
		t.Fatalf("no PostgreSQL migrations found (%v)", err)
	}
	slices.Sort(migs)
	newest := filepath.ToSlash(strings.TrimPrefix(migs[len(migs)-1], ".."+string(filepath.Separator)))
	added, err := git("log", "--follow", "--diff-filter=A", "--format=%H", "--", newest)
	if err != nil {
		return "", fmt.Sprintf("git log: %v", err)
	}
	if added == "" {
		// The newest migration is only in the working tree: HEAD is the
		// release before it.
		head, err := git("rev-parse", "HEAD")
		if err != nil {
			return "", "no HEAD commit"
		}
		return head, "HEAD, before the uncommitted " + filepath.Base(newest)
	}
	added = strings.Fields(added)[0]
	parent, err := git("rev-parse", "--verify", "--quiet", added+"^1^{commit}")
	if err != nil || parent == "" {
		return "", fmt.Sprintf("the parent of %s (which added %s) is not in this clone (shallow?)", added[:12], filepath.Base(newest))
	}
	return parent, "before " + filepath.Base(newest)
}

// buildRelease extracts rev's tree (git archive) into dir and builds its
// better-compute there; it returns the binary's path.
func buildRelease(rev, dir string) (string, error) {
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	archive := exec.Command("git", "-C", "..", "archive", "--format=tar", rev)
	untar := exec.Command("tar", "-x", "-C", src)
	pipe, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	untar.Stdin = pipe
	var aerr, uerr strings.Builder
	archive.Stderr, untar.Stderr = &aerr, &uerr
	if err := untar.Start(); err != nil {
		return "", err
	}
	if err := archive.Run(); err != nil {
		_ = untar.Wait()
		return "", fmt.Errorf("git archive %s: %v: %s", rev, err, aerr.String())
	}
	if err := untar.Wait(); err != nil {
		return "", fmt.Errorf("untar %s: %v: %s", rev, err, uerr.String())
	}
	bin := filepath.Join(dir, "bin", "better-compute")
	// -trimpath: without it the objects record this temporary directory,
	// and no run could reuse the build cache of the one before.
	build := exec.Command("go", "build", "-trimpath", "-o", bin, "./cmd/better-compute")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build the previous release %s: %v\n%s", rev, err, out)
	}
	if _, err := os.Stat(bin); err != nil {
		return "", errors.New("the previous release built no better-compute")
	}
	return bin, nil
}
