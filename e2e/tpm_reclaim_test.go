package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// R15.3, R9.2 with real processes (docs/tpm.md, "A machine that lost its
// node key" and "A node whose TPM changed"): on a pool with allow_reclaim,
// `bcd join --reset --yes` then `bcd join --attestor tpm` on the same swtpm
// keeps the node id at its next identity generation. After the TPM is
// replaced (another EK from a trusted CA), the join is refused
// (tpm:reclaim: the machine's node belongs to another TPM) until the old
// node is retired; then it joins as a new node.
func TestTPMReclaimAfterReset(t *testing.T) {
	bc, bcd := binaries(t)
	tpmA, tpmB := tpmtest.Start(t), tpmtest.StartFresh(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	args := []string{"--tpm-allow-reclaim", "--tpm-simulator", tpmA.Addr}
	for _, ca := range append(append([]string{}, tpmA.CAFiles...), tpmB.CAFiles...) {
		args = append(args, "--tpm-ca-file", ca)
	}
	conf := filepath.Join(data, "bcd", "config.toml")
	env := startDev(t, bc, data, conf, args...)
	e := envList(env)
	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-TPM-9", "4c4c4544-0042-3510-8053-b7c04f5a7009", "3c:ec:ef:07:00:09")

	join := func(extra ...string) string {
		t.Helper()
		out, errOut, code := run(t, nil, "", bcd, append([]string{"join", "--config", conf, "--attestor", "tpm", "--sysfs-root", sys, "--json"}, extra...)...)
		if code != 0 {
			t.Fatalf("bcd join --attestor tpm %v: %s\n%s", extra, out, errOut)
		}
		id, _ := jsonOf(t, out)["nodeId"].(string)
		if !strings.HasPrefix(id, "node_") {
			t.Fatalf("bcd join --json: %s", out)
		}
		return id
	}
	node := func(id string) map[string]any {
		t.Helper()
		out, errOut, code := run(t, e, "", bc, "nodes", "get", id, "--tenant", env["TENANT"], "--json")
		if code != 0 {
			t.Fatalf("nodes get %s: %s", id, errOut)
		}
		return jsonOf(t, out)
	}
	first := join()
	again := join("--reset", "--yes")
	if again != first {
		t.Fatalf("after bcd join --reset --yes the same TPM joined as %s, want its node %s back", again, first)
	}
	if g := node(first)["identityGeneration"]; g != float64(2) && g != "2" {
		t.Fatalf("reclaimed node at identity generation %v, want 2", g)
	}

	// The TPM is replaced: bcd's config names the other swtpm.
	raw, err := os.ReadFile(conf)
	must(t, err)
	must(t, os.WriteFile(conf, []byte(strings.ReplaceAll(string(raw), tpmA.Addr, tpmB.Addr)), 0o600))
	// The machine's hardware key names a node whose TPM this is not: the
	// join is refused (tpm:reclaim) and the old identity stays in place.
	out, errOut, code := run(t, nil, "", bcd, "join", "--config", conf, "--attestor", "tpm", "--sysfs-root", sys, "--reset", "--yes")
	if code == 0 || !strings.Contains(errOut, "Join refused") {
		t.Fatalf("a replaced TPM took the node back: %s %s", out, errOut)
	}
	// The hint names what works for a tpm join, which takes no token.
	if !strings.Contains(errOut, "[[join.tpm.pools]]") || !strings.Contains(errOut, "--attestor tpm again") || strings.Contains(errOut, "--allow-reclaim") {
		t.Fatalf("a refused tpm reset hints at a token's step: %s", errOut)
	}
	refusals, _, _ := run(t, e, "", bc, "events", "list", "--tenant", env["TENANT"], "--type", "security.join.refused", "--json")
	if !strings.Contains(refusals, `"reason":"tpm:reclaim"`) {
		t.Fatalf("no tpm:reclaim refusal recorded: %s", refusals)
	}
	// As docs/tpm.md says: retire the old node, then join again.
	if _, errOut, code := run(t, e, "", bc, "nodes", "retire", first, "--tenant", env["TENANT"], "--reason", "TPM replaced"); code != 0 {
		t.Fatalf("nodes retire: %s", errOut)
	}
	replaced := join("--reset", "--yes")
	if replaced == first {
		t.Fatalf("the replaced TPM joined as the retired node %s", first)
	}
	if n := node(replaced); n["nodeKey"] != "tpm" {
		t.Fatalf("node after the TPM was replaced: %v", n)
	}
}
