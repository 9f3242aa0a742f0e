package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// R9.1, R9.2, R10.1 with real processes: better-compute dev running the tpm
// attestor for its pool (--tpm-ca-file trusting one swtpm's local CA,
// --tpm-enrollment), its gateway, bcd and two swtpm. The machine whose EK
// the CA certified joins with no token: nodeKey tpm, node.key a TPM key
// record. The other TPM's EK is unknown: its bcd waits on a join request,
// an operator approves it with the CLI, and the waiting bcd finishes on its
// own.
func TestTPMJoinWithoutToken(t *testing.T) {
	bc, bcd := binaries(t)
	known, unknown := tpmtest.Start(t), tpmtest.StartFresh(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	args := []string{"--tpm-enrollment", "--tpm-simulator", known.Addr}
	for _, ca := range known.CAFiles {
		args = append(args, "--tpm-ca-file", ca)
	}
	conf := filepath.Join(data, "bcd", "config.toml")
	env := startDev(t, bc, data, conf, args...)
	e := envList(env)

	// The known TPM: no token at all.
	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-TPM-1", "4c4c4544-0042-3510-8053-b7c04f5a7001", "3c:ec:ef:07:00:01")
	out, errOut, code := run(t, nil, "", bcd, "join", "--config", conf, "--attestor", "tpm", "--sysfs-root", sys, "--json")
	if code != 0 {
		t.Fatalf("bcd join --attestor tpm: %s\n%s", out, errOut)
	}
	joined := jsonOf(t, out)
	nodeID, _ := joined["nodeId"].(string)
	if !strings.HasPrefix(nodeID, "node_") {
		t.Fatalf("bcd join --json: %s", out)
	}
	key, err := os.ReadFile(filepath.Join(data, "bcd", "data", "node.key"))
	must(t, err)
	if !strings.HasPrefix(string(key), "-----BEGIN TSS2 PRIVATE KEY-----") {
		t.Fatalf("node.key is not a TPM key record:\n%s", key)
	}
	out, _, _ = run(t, e, "", bc, "nodes", "get", nodeID, "--tenant", env["TENANT"], "--json")
	if n := jsonOf(t, out); n["nodeKey"] != "tpm" || n["attestor"] != "tpm" {
		t.Fatalf("node after the tpm join: %s", out)
	}
	if out, errOut, code := run(t, nil, "", bcd, "status", "--config", conf); code != 0 {
		t.Fatalf("bcd status: %s %s", out, errOut)
	}

	// The unknown TPM: another machine, its own config pointing at it.
	conf2dir := filepath.Join(dir, "bcd-2")
	must(t, os.MkdirAll(conf2dir, 0o755))
	raw, err := os.ReadFile(conf)
	must(t, err)
	if !strings.Contains(string(raw), known.Addr) {
		t.Fatalf("dev's bcd config does not name the swtpm:\n%s", raw)
	}
	conf2 := filepath.Join(conf2dir, "config.toml")
	must(t, os.WriteFile(conf2, []byte(strings.ReplaceAll(string(raw), known.Addr, unknown.Addr)), 0o600))
	jwk, err := os.ReadFile(filepath.Join(data, "bcd", "join-encryption.jwk"))
	must(t, err)
	must(t, os.WriteFile(filepath.Join(conf2dir, "join-encryption.jwk"), jwk, 0o644))
	sys2 := filepath.Join(dir, "sys-2")
	fakeSysfs(t, sys2, "SN-TPM-2", "4c4c4544-0042-3510-8053-b7c04f5a7002", "3c:ec:ef:07:00:02")
	waiting := start(t, nil, bcd, "join", "--config", conf2, "--attestor", "tpm", "--sysfs-root", sys2, "--data-dir", filepath.Join(dir, "bcd-2-data"))
	id := waitingRequest(t, waiting)
	out, errOut, code = run(t, e, "", bc, "join-requests", "list", "--tenant", env["TENANT"], "--pool", env["POOL"], "--json")
	if code != 0 || !strings.Contains(out, id) || !strings.Contains(out, `"tpm"`) {
		t.Fatalf("join-requests list: %s %s", out, errOut)
	}
	if _, errOut, code := run(t, e, "", bc, "join-requests", "approve", id, "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "900",
		"--reason", "new rack, TPM not in the allow-list yet"); code != 0 {
		t.Fatalf("approve: %s", errOut)
	}
	if code := waiting.exited(t, 90*time.Second); code != 0 {
		t.Fatalf("the approved bcd join exited %d:\n%s", code, waiting.output())
	}
	m := regexp.MustCompile(`joined as (node_[0-9a-z]+)`).FindStringSubmatch(waiting.output())
	if m == nil {
		t.Fatalf("the approved bcd join did not report its node:\n%s", waiting.output())
	}
	out, _, _ = run(t, e, "", bc, "nodes", "get", m[1], "--tenant", env["TENANT"], "--json")
	if n := jsonOf(t, out); n["nodeKey"] != "tpm" || n["attestor"] != "tpm" {
		t.Fatalf("node after the enrolled tpm join: %s", out)
	}
	out, _, _ = run(t, e, "", bc, "events", "list", "--tenant", env["TENANT"], "--json")
	for _, want := range []string{"security.join-request.created", "security.join-request.approved", "node.joined"} {
		if !strings.Contains(out, want) {
			t.Errorf("event %s missing from the stream", want)
		}
	}
}
