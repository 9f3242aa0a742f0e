package e2e

import (
	"fmt"
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

// R22.1, R22.2 with real processes: better-compute dev with
// --tpm-enrollment and two swtpm TPMs in two machines that report the same
// claims (one fake sysfs). Both bcd wait, on two requests that the CLI's
// list shows with the same claims and hardware key but their own EKs, each
// naming the other as having the same claims. Approving one (bound to the
// version listed) admits that machine only; the other still waits.
func TestTPMSameClaimsTwoRequests(t *testing.T) {
	bc, bcd := binaries(t)
	first, second := tpmtest.StartFresh(t), tpmtest.StartFresh(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	conf := filepath.Join(data, "bcd", "config.toml")
	env := startDev(t, bc, data, conf, "--tpm-enrollment", "--tpm-simulator", first.Addr)
	e := envList(env)
	raw, err := os.ReadFile(conf)
	must(t, err)
	jwk, err := os.ReadFile(filepath.Join(data, "bcd", "join-encryption.jwk"))
	must(t, err)
	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-CLONE", "4c4c4544-0042-3510-8053-b7c04f5a7101", "3c:ec:ef:07:01:01")
	waiting := map[string]*proc{}
	for i, sim := range []*tpmtest.Sim{first, second} {
		cdir := filepath.Join(dir, fmt.Sprintf("bcd-%d", i))
		must(t, os.MkdirAll(cdir, 0o755))
		c := filepath.Join(cdir, "config.toml")
		must(t, os.WriteFile(c, []byte(strings.ReplaceAll(string(raw), first.Addr, sim.Addr)), 0o600))
		must(t, os.WriteFile(filepath.Join(cdir, "join-encryption.jwk"), jwk, 0o644))
		p := start(t, nil, bcd, "join", "--config", c, "--attestor", "tpm", "--sysfs-root", sys, "--data-dir", filepath.Join(cdir, "data"))
		waiting[waitingRequest(t, p)] = p
	}
	if len(waiting) != 2 {
		t.Fatalf("two TPMs wait on %d requests, want two", len(waiting))
	}
	list := func() []map[string]any {
		t.Helper()
		out, errOut, code := run(t, e, "", bc, "join-requests", "list", "--tenant", env["TENANT"], "--pool", env["POOL"], "--json")
		if code != 0 {
			t.Fatalf("join-requests list: %s %s", out, errOut)
		}
		items, _ := jsonOf(t, out)["items"].([]any)
		var rs []map[string]any
		for _, it := range items {
			rs = append(rs, it.(map[string]any))
		}
		return rs
	}
	rs := list()
	if len(rs) != 2 {
		t.Fatalf("%d pending requests, want two", len(rs))
	}
	ek := func(r map[string]any) string { s, _ := r["evidence"].(map[string]any)["ekSha256"].(string); return s }
	if rs[0]["hardwareKey"] == "" || rs[0]["hardwareKey"] != rs[1]["hardwareKey"] || len(ek(rs[0])) != 64 || len(ek(rs[1])) != 64 || ek(rs[0]) == ek(rs[1]) {
		t.Fatalf("requests %v: want the same hardware key and two EKs", rs)
	}
	out, _, _ := run(t, e, "", bc, "join-requests", "list", "--tenant", env["TENANT"], "--pool", env["POOL"])
	for _, r := range rs {
		if !strings.Contains(out, "ek "+ek(r)[:16]+"…") {
			t.Errorf("the list table lacks %s's EK:\n%s", r["id"], out)
		}
	}
	if strings.Count(out, "SAME CLAIMS as") != 2 {
		t.Errorf("the list table does not flag both requests as having the same claims:\n%s", out)
	}
	approved, other := rs[1]["id"].(string), rs[0]["id"].(string)
	if _, errOut, code := run(t, e, "", bc, "join-requests", "approve", approved, "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "900",
		"--reason", "EK checked against the machine", "--version", rs[1]["version"].(string)); code != 0 {
		t.Fatalf("approve: %s", errOut)
	}
	if code := waiting[approved].exited(t, 90*time.Second); code != 0 || !strings.Contains(waiting[approved].output(), "joined as node_") {
		t.Fatalf("the approved bcd join exited %d:\n%s", code, waiting[approved].output())
	}
	select {
	case <-waiting[other].done:
		t.Fatalf("the other TPM's bcd exited:\n%s", waiting[other].output())
	default:
	}
	for _, r := range list() {
		if r["id"] != other {
			t.Fatalf("pending after the approval: %v, want only %s", r, other)
		}
	}
}
