package e2e

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// `bcd run` renews again and again: serve (SQLite) with one-minute node
// certificates and a separate gateway; a machine joins with bcd, then the
// daemon holds its session (the node is connected) and renews at about 60%
// of the lifetime (45% to 75%), over its session's connection, each renewal a new node_certs row of the same identity
// generation and a new serial in bcd's identity. R12.1, R13.1, R13.2
func TestBcdRunRenewsRepeatedly(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for two renewals of one-minute certificates (about 80 s)")
	}
	s := startStack(t, stackOpts{Advertise: true, CertTTLSeconds: 60})
	bc, bcd, dir, e, tenant := s.bc, s.bcd, s.dir, s.env, s.tenant
	site, pool := s.sitePool("eu-1")
	token := s.cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h")["token"].(string)

	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-6060", "6060aaaa-4455-6677-8899-aabbccddeeff", "3c:ec:ef:60:60:60")
	conf := filepath.Join(dir, "etc-bcd", "config.toml")
	out, errOut, code := run(t, nil, token+"\n", bcd, s.joinServer(conf, site, "--data-dir", filepath.Join(dir, "bcd-data"), "--sysfs-root", sys, "--json")...)
	if code != 0 {
		t.Fatalf("bcd join: %s\n%s", out, errOut)
	}
	joined := jsonOf(t, out)
	nodeID, _ := joined["node_id"].(string)
	if nodeID == "" {
		nodeID, _ = joined["nodeId"].(string)
	}
	if !strings.HasPrefix(nodeID, "node_") {
		t.Fatalf("bcd join --json: %s", out)
	}
	serial := func() string {
		out, errOut, code := run(t, nil, "", bcd, "status", "--config", conf, "--json")
		if code != 0 {
			t.Fatalf("bcd status: %s %s", out, errOut)
		}
		st := jsonOf(t, out)
		if st["expired"] == true {
			t.Fatalf("bcd's certificate is expired: %s", out)
		}
		sn, _ := st["serial"].(string)
		return sn
	}
	serials := []string{serial()}
	if serials[0] == "" {
		t.Fatal("no serial after the join")
	}

	// The daemon: session and renewal loop in one process.
	daemon := start(t, nil, bcd, "run", "--config", conf)
	node := func() map[string]any {
		out, errOut, code := run(t, e, "", bc, "nodes", "get", nodeID, "--tenant", tenant, "--json")
		if code != 0 {
			t.Fatalf("nodes get: %s %s", out, errOut)
		}
		return jsonOf(t, out)
	}
	waitFor(t, "the node to be connected", 30*time.Second, func() bool { return node()["connection"] == "connected" })

	// Two renewals at 27 to 45 s each (45% to 75% of 60 s): bcd's serial
	// changes twice, and each renewal is a node_certs row.
	deadline := time.Now().Add(150 * time.Second)
	for len(serials) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("after 150 s, %d renewal(s): serials %v\n%s", len(serials)-1, serials, daemon.output())
		}
		if sn := serial(); sn != serials[len(serials)-1] {
			serials = append(serials, sn)
			t.Logf("renewal %d: serial %s", len(serials)-1, sn)
		}
		time.Sleep(500 * time.Millisecond)
	}
	n := node()
	certs, _ := n["certs"].([]any)
	if len(certs) < 3 {
		t.Fatalf("%d certificates after two renewals: %v", len(certs), n)
	}
	stored := map[string]bool{}
	for _, c := range certs {
		c := c.(map[string]any)
		stored[strings.ToLower(c["serial"].(string))] = true
		if c["identityGeneration"] != float64(1) || c["revokedAt"] != nil {
			t.Errorf("certificate %v: want identity generation 1, not revoked", c)
		}
	}
	for _, s := range serials {
		if !stored[strings.ToLower(s)] {
			t.Errorf("bcd's serial %s is not among the node's certificates %v", s, certs)
		}
	}
	if n["identityGeneration"] != float64(1) {
		t.Errorf("identity generation %v, want 1", n["identityGeneration"])
	}
	// The session outlived the renewals (bcd reconnects with the new
	// certificate).
	waitFor(t, "the node to be connected after the renewals", 30*time.Second, func() bool { return node()["connection"] == "connected" })
	if got := strings.Count(daemon.output(), "certificate renewed"); got < 2 {
		t.Errorf("bcd run logged %d renewals, want at least 2:\n%s", got, daemon.output())
	}
	out, _, _ = run(t, e, "", bc, "events", "list", "--tenant", tenant, "--json")
	if got := strings.Count(out, "node.certificate-renewed"); got < 2 {
		t.Errorf("%d node.certificate-renewed events, want at least 2", got)
	}
	if strings.Contains(out, "security.renew.refused") {
		t.Errorf("a renewal was refused:\n%s", out)
	}
}
