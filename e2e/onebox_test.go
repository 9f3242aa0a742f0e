package e2e

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// One process: serve with [gateway] listen runs the gateway itself and
// relays to the API in memory, with no agent listener. A real bcd joins
// through it, renews, holds its session (the node is adopted: the
// acceptance check ran as a signed command) and runs a signed node.facts
// command; the gateway's /readyz asks the API in memory. R4.1, R12.1,
// R12.3, R13.1, R17.2
func TestOneProcessServeWithGateway(t *testing.T) {
	s := startStack(t, stackOpts{Gateway: gatewayInServe, Advertise: true, GatewayMetrics: true})
	bc, bcd, dir, gw, gwMetrics := s.bc, s.bcd, s.dir, s.gw, s.gwMetrics
	// listenAgent logs before the API says it listens: no agent listener.
	if out := s.serve.output(); strings.Contains(out, "agent listener") || !strings.Contains(out, "upstream=http://in-process") {
		t.Fatalf("serve's log does not show the in-process gateway alone:\n%s", out)
	}
	res, err := http.Get("http://" + gwMetrics + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	_ = res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("the gateway's /readyz: %s", res.Status)
	}

	e, tenant := s.env, s.tenant
	cli := func(args ...string) map[string]any {
		t.Helper()
		return s.cli(append(args, "--tenant", tenant)...)
	}
	site := cli("sites", "create", "eu-1")["id"].(string)
	pool := cli("pools", "create", "gpu", "--site", site)["id"].(string)
	token := cli("join-tokens", "create", "--pool", pool, "--ttl", "1h")["token"].(string)

	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-0B0X", "0b0baaaa-4455-6677-8899-aabbccddeeff", "3c:ec:ef:0b:0b:0b")
	conf := filepath.Join(dir, "etc-bcd", "config.toml")
	out, errOut, code := run(t, nil, token+"\n", bcd, s.joinServer(conf, site, "--data-dir", filepath.Join(dir, "bcd-data"), "--sysfs-root", sys, "--json")...)
	if code != 0 {
		t.Fatalf("bcd join: %s\n%s", out, errOut)
	}
	bconf, err := os.ReadFile(conf)
	must(t, err)
	if !strings.Contains(string(bconf), `gateway_url = "https://`+gw+`"`) {
		t.Fatalf("bcd's config does not name the in-process gateway %s", gw)
	}
	serial := func() string {
		out, errOut, code := run(t, nil, "", bcd, "status", "--config", conf, "--json")
		if code != 0 {
			t.Fatalf("bcd status: %s %s", out, errOut)
		}
		sn, _ := jsonOf(t, out)["serial"].(string)
		return sn
	}
	joined := serial()
	if out, errOut, code := run(t, nil, "", bcd, "renew", "--config", conf); code != 0 {
		t.Fatalf("bcd renew: %s\n%s", out, errOut)
	}
	if renewed := serial(); renewed == "" || renewed == joined {
		t.Fatalf("serial %q after the renewal, %q before", renewed, joined)
	}

	start(t, nil, bcd, "run", "--config", conf)
	var nodeID string
	waitFor(t, "the node adopted over its session", 60*time.Second, func() bool {
		out, _, code := run(t, e, "", bc, "nodes", "list", "--tenant", tenant, "--json")
		if code != 0 {
			return false
		}
		items, _ := jsonOf(t, out)["items"].([]any)
		if len(items) != 1 {
			return false
		}
		n := items[0].(map[string]any)
		nodeID, _ = n["id"].(string)
		return n["state"] == "adopted" && n["connection"] == "connected"
	})
	c := cli("commands", "enqueue", nodeID, "--kind", "node.facts", "--wait")
	if c["state"] != "done" || c["result"] == nil {
		t.Fatalf("node.facts: %v", c)
	}
}
