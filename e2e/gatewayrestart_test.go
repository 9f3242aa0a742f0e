package e2e

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Sessions survive a gateway killed and restarted (R19.3): 30 `bcd run`
// daemons with one-minute certificates hold sessions through a gateway;
// it is killed with SIGKILL and started again on the same port. All 30
// sessions are back within 30 s, then stay up for 3 minutes while every
// daemon renews about five times.
//
// The criterion for "stay up": each renewal ends the node's session and
// bcd reconnects at once on the new certificate, so a node may show
// disconnected for a moment. Each node is polled once a second; a node
// counts as down only when it is seen disconnected on consecutive polls
// spanning more than downGrace (10 s, far above a renewal reconnect and
// far below a backoff loop of 1 s doubling). No daemon may exit, and no
// renewal may be refused.
func TestSessionsSurviveGatewayRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("30 daemons through a gateway killed and restarted, then 3 minutes of renewals (about 4 minutes)")
	}
	const machines, downGrace = 30, 10 * time.Second
	f := startSessionFleet(t, machines)
	bc, e, tenant, gwConf, daemons, gateway := f.bc, f.env, f.tenant, f.gwConf, f.daemons, f.gateway
	connected := func() map[string]bool {
		out, errOut, code := run(t, e, "", bc, "nodes", "list", "--tenant", tenant, "--json")
		if code != 0 {
			t.Fatalf("nodes list: %s %s", out, errOut)
		}
		var list struct {
			Items []struct{ ID, Connection string } `json:"items"`
		}
		must(t, json.Unmarshal([]byte(out), &list))
		up := map[string]bool{}
		for _, n := range list.Items {
			up[n.ID] = n.Connection == "connected"
		}
		return up
	}
	count := func(up map[string]bool) int {
		n := 0
		for _, ok := range up {
			if ok {
				n++
			}
		}
		return n
	}
	waitFor(t, "30 sessions", 90*time.Second, func() bool { return count(connected()) == machines })

	// Kill the gateway and start it again on the same port. Each daemon
	// must open a new session (its log says "session open" once more),
	// so the count is not the API's view from before the kill.
	opened := make([]int, machines)
	for i, d := range daemons {
		opened[i] = strings.Count(d.output(), "session open")
	}
	must(t, gateway.cmd.Process.Kill())
	<-gateway.done
	killed := time.Now()
	gateway = start(t, nil, bc, "gateway", "--config", gwConf)
	waitFor(t, "the restarted gateway", 30*time.Second, func() bool { return strings.Contains(gateway.output(), "gateway listening") })
	waitFor(t, "30 sessions after the gateway restart", 30*time.Second-time.Since(killed), func() bool {
		for i, d := range daemons {
			if strings.Count(d.output(), "session open") <= opened[i] {
				return false
			}
		}
		return count(connected()) == machines
	})
	t.Logf("30 sessions back %s after the kill", time.Since(killed).Round(100*time.Millisecond))

	// Three minutes of renewals: no node down longer than downGrace.
	downSince := map[string]time.Time{}
	var worst time.Duration
	for end := time.Now().Add(3 * time.Minute); time.Now().Before(end); time.Sleep(time.Second) {
		now := time.Now()
		for id, ok := range connected() {
			switch since, down := downSince[id]; {
			case ok:
				delete(downSince, id)
			case !down:
				downSince[id] = now
			case now.Sub(since) > downGrace:
				t.Fatalf("node %s disconnected for %s (more than %s)", id, now.Sub(since).Round(time.Second), downGrace)
			default:
				worst = max(worst, now.Sub(since))
			}
		}
		for i, d := range daemons {
			select {
			case <-d.done:
				t.Fatalf("bcd run %d exited:\n%s", i, d.output())
			default:
			}
		}
	}
	t.Logf("longest disconnection seen during 3 minutes of renewals: %s", worst.Round(time.Second))
	out, _, _ := run(t, e, "", bc, "events", "list", "--tenant", tenant, "--json")
	if strings.Contains(out, "security.renew.refused") {
		t.Errorf("a renewal was refused:\n%s", out)
	}
}

// sessionFleet is serve (SQLite, one-minute certificates), a gateway, and
// `bcd run` daemons joined through it.
type sessionFleet struct {
	bc, tenant, gwConf string
	env                []string
	gateway            *proc
	daemons            []*proc
}

// startSessionFleet starts serve and a gateway, joins machines with bcd and
// starts a `bcd run` for each.
func startSessionFleet(t *testing.T, machines int) *sessionFleet {
	t.Helper()
	s := startStack(t, stackOpts{Advertise: true, CertTTLSeconds: 60})
	bc, bcd, dir := s.bc, s.bcd, s.dir
	site, pool := s.sitePool("eu-1")
	token := s.cli("join-tokens", "create", "--tenant", s.tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(machines))["token"].(string)

	daemons := make([]*proc, machines)
	for i := range machines {
		sys := filepath.Join(dir, fmt.Sprintf("sys-%d", i))
		fakeSysfs(t, sys, fmt.Sprintf("SN-GW-%02d", i), fmt.Sprintf("7070aaaa-4455-6677-8899-aabbccddee%02x", i), fmt.Sprintf("3c:ec:ef:70:70:%02x", i))
		conf := filepath.Join(dir, fmt.Sprintf("etc-bcd-%d", i), "config.toml")
		out, errOut, code := run(t, nil, token+"\n", bcd, s.joinServer(conf, site, "--data-dir", filepath.Join(dir, fmt.Sprintf("bcd-data-%d", i)),
			"--sysfs-root", sys, "--json")...)
		if code != 0 {
			t.Fatalf("bcd join %d: %s\n%s", i, out, errOut)
		}
		daemons[i] = start(t, nil, bcd, "run", "--config", conf)
	}
	return &sessionFleet{bc: bc, tenant: s.tenant, gwConf: s.gatewayConf, env: s.env, gateway: s.gateway, daemons: daemons}
}
