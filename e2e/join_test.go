package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// docs/joining.md's token join against `better-compute dev`, the way a new user
// tries it: dev, source dev.env, mint a token, bcd join, nodes list; then a
// second join is "already joined", and --reset --yes with a reclaim token
// brings the same node back at the next identity generation.
// R4.1–R4.6, R6.3, R11.1, R11.2, R11.4
func TestDevTokenJoin(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	// dev takes its ports from its own listeners and writes them into
	// dev.env and the bcd config.
	dev := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	waitFor(t, "dev to write dev.env", 30*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(data, "bcd", "config.toml"))
		return err == nil && strings.Contains(dev.output(), "gateway listening")
	})
	env := readEnv(t, filepath.Join(data, "dev.env"))
	e := envList(env)

	// The bcd config dev wrote, pointed at a fake machine.
	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-7701", "4c4c4544-0042-3510-8053-b7c04f5a3132", "3c:ec:ef:01:02:03")
	conf := filepath.Join(data, "bcd", "config.toml")

	tokenFile := filepath.Join(dir, "join-token")
	if out, errOut, code := run(t, e, "", bc, "join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "1h",
		"--expect-serial", "SN-7701", "--key", "adopt-rack-b7-u12", "--out", tokenFile); code != 0 {
		t.Fatalf("create token: %s %s", out, errOut)
	}
	st, err := os.Stat(tokenFile)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("token file: %v %v", st, err)
	}
	token, _ := os.ReadFile(tokenFile)

	// A token as an argument is refused (R11.2).
	if _, errOut, code := run(t, nil, "", bcd, "join", "--config", conf, "--sysfs-root", sys, strings.TrimSpace(string(token))); code == 0 || strings.Contains(errOut, strings.TrimSpace(string(token))) {
		t.Fatalf("token as argument: code %d, %s", code, errOut)
	}
	out, errOut, code := run(t, nil, string(token), bcd, "join", "--config", conf, "--sysfs-root", sys, "--json")
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
	if _, _, code := run(t, nil, "", bcd, "status", "--config", conf); code != 0 {
		t.Fatal("bcd status after join failed")
	}
	key, err := os.Stat(filepath.Join(data, "bcd", "data", "node.key"))
	if err != nil || key.Mode().Perm() != 0o600 {
		t.Fatalf("node.key: %v %v", key, err)
	}

	// The node is adopted by the controllers (pool without acceptance checks).
	waitFor(t, "node adopted", 20*time.Second, func() bool {
		out, _, _ := run(t, e, "", bc, "nodes", "get", nodeID, "--tenant", env["TENANT"], "--json")
		return jsonOf(t, out)["state"] == "adopted"
	})

	// Already joined.
	if _, errOut, code := run(t, nil, string(token), bcd, "join", "--config", conf, "--sysfs-root", sys); code == 0 || !strings.Contains(errOut, "already joined") {
		t.Fatalf("second join: %d %s", code, errOut)
	}
	// The used token again, after a reset: refused, and the agent learns nothing.
	reclaimFile := filepath.Join(dir, "reclaim-token")
	if _, errOut, code := run(t, e, "", bc, "join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "10m", "--allow-reclaim", "--out", reclaimFile); code != 0 {
		t.Fatal(errOut)
	}
	reclaim, _ := os.ReadFile(reclaimFile)
	out, errOut, code = run(t, nil, string(reclaim), bcd, "join", "--config", conf, "--sysfs-root", sys, "--reset", "--yes", "--json")
	if code != 0 {
		t.Fatalf("reset and join: %s %s", out, errOut)
	}
	if !strings.Contains(out, nodeID) {
		t.Fatalf("reclaim landed on another node: %s", out)
	}
	out, _, _ = run(t, e, "", bc, "nodes", "get", nodeID, "--tenant", env["TENANT"], "--json")
	node := jsonOf(t, out)
	certs, _ := node["certs"].([]any)
	if node["identityGeneration"] != float64(2) || len(certs) != 2 || certs[1].(map[string]any)["revokeReason"] != "reclaimed" {
		t.Fatalf("node after reclaim: %s", out)
	}
	out, _, _ = run(t, e, "", bc, "events", "list", "--tenant", env["TENANT"], "--json")
	for _, want := range []string{"security.join-token.created", "node.joined", "node.adopted", "security.certificate-revoked"} {
		if !strings.Contains(out, want) {
			t.Errorf("event %s missing from the stream", want)
		}
	}
}

// The production shape: serve on PostgreSQL and a separate gateway process,
// set up with pki init, issue-gateway, bootstrap and the CLI. R3.1, R4
func TestServeGatewayPostgres(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	s := startStack(t, stackOpts{Store: fmt.Sprintf("driver = \"postgres\"\ndsn = %q", dsn), Advertise: true})
	bc, bcd, dir := s.bc, s.bcd, s.dir
	if _, errOut, code := run(t, s.secretEnv, "", bc, "pki", "init", "--trust-domain", "compute.example.com"); code == 0 || !strings.Contains(errOut, "ALREADY_EXISTS") {
		t.Fatalf("second pki init: %d %s", code, errOut)
	}
	e, tenant := s.env, s.tenant
	site, pool := s.sitePool("eu-1")
	token := s.cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h")["token"].(string)

	// A host without config.toml joins from the well-known document and the
	// pins it was installed with (R11.3), then writes its config.
	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-9000", "00112233-4455-6677-8899-aabbccddeeff", "3c:ec:ef:0a:0b:0c")
	etc := filepath.Join(dir, "etc-bcd")
	conf := filepath.Join(etc, "config.toml")
	out, errOut, code := run(t, nil, token+"\n", bcd, s.joinServer(conf, site, "--data-dir", filepath.Join(dir, "bcd-data"), "--sysfs-root", sys)...)
	if code != 0 {
		t.Fatalf("bcd join from the well-known document: %s\n%s", out, errOut)
	}
	for _, f := range []string{"config.toml", "join-encryption.jwk"} {
		if _, err := os.Stat(filepath.Join(etc, f)); err != nil {
			t.Errorf("%s not written: %v", f, err)
		}
	}
	waitFor(t, "node adopted", 20*time.Second, func() bool {
		out, _, _ := run(t, e, "", bc, "nodes", "list", "--tenant", tenant, "--json")
		items, _ := jsonOf(t, out)["items"].([]any)
		return len(items) == 1 && items[0].(map[string]any)["state"] == "adopted"
	})
}
