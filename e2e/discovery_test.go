package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// R10.1–R10.4 with real processes: better-compute dev (API, gateway, the
// site module's tokens), a site agent (bcd join --role site, bcd run), the
// boot module's word (bcd site vouch), ramdisks joining with the discovery
// attestor and waiting, and an operator approving one and rejecting the
// other with the CLI. The approved bcd finishes on its own; the rejected
// one exits non-zero and says so.
func TestDiscoveryJoinWaitsForApproval(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	siteConf := filepath.Join(data, "site", "config.toml")
	ramdiskConf := filepath.Join(data, "ramdisk", "config.toml")
	env := startDev(t, bc, data, ramdiskConf)
	e := envList(env)
	secret := func(name string) string {
		path := filepath.Join(data, "secrets", name)
		st, err := os.Stat(path)
		if err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("secret %s: %v %v, want a 0600 file (R2.7)", path, st, err)
		}
		b, err := os.ReadFile(path)
		must(t, err)
		return string(b)
	}

	// The site agent.
	out, errOut, code := run(t, nil, secret("site.token"), bcd, "join", "--config", siteConf, "--role", "site", "--json")
	if code != 0 {
		t.Fatalf("site agent join: %s %s", out, errOut)
	}
	agentID, _ := jsonOf(t, out)["node_id"].(string)
	start(t, nil, bcd, "run", "--config", siteConf)

	// The boot module's word on two machines, then their ramdisks join.
	const mac1, mac2 = "00:1b:21:0a:0b:0c", "00:1b:21:0a:0b:0d"
	for _, m := range []struct{ mac, ip string }{{mac1, "10.0.0.7"}, {mac2, "10.0.0.8"}} {
		if _, errOut, code := run(t, nil, "", bcd, "site", "vouch", "--config", siteConf, "--mac", m.mac, "--ip", m.ip, "--lease-epoch", "1"); code != 0 {
			t.Fatalf("bcd site vouch: %s", errOut)
		}
	}
	waitFor(t, "the site agent's vouches", 30*time.Second, func() bool {
		out, _, _ := run(t, e, "", bc, "events", "list", "--tenant", env["TENANT"], "--json")
		return strings.Count(out, "site.machines-vouched") > 0 && strings.Contains(out, mac2)
	})
	sys2 := filepath.Join(dir, "sys-2")
	fakeSysfs(t, sys2, "PXE-8", "4c4c4544-0042-3510-8052-c7c04f5a0008", mac2)
	ramdisk := func(args ...string) *proc {
		return start(t, []string{"BCD_JOIN_TOKEN=" + strings.TrimSpace(secret("ramdisk.token"))}, bcd, append([]string{"join", "--config", ramdiskConf,
			"--attestor", "discovery", "--role", "ramdisk", "--boot-lease-epoch", "1"}, args...)...)
	}
	approved := ramdisk("--boot-mac", mac1, "--boot-ip", "10.0.0.7")
	rejected := ramdisk("--boot-mac", mac2, "--boot-ip", "10.0.0.8", "--data-dir", filepath.Join(dir, "ramdisk-2"), "--sysfs-root", sys2)

	id1, id2 := waitingRequest(t, approved), waitingRequest(t, rejected)

	// The operator sees what the attestor saw.
	out, errOut, code = run(t, e, "", bc, "join-requests", "list", "--tenant", env["TENANT"], "--pool", env["POOL"], "--json")
	if code != 0 {
		t.Fatalf("join-requests list: %s %s", out, errOut)
	}
	for _, want := range []string{id1, id2, mac1, agentID, `"bootLeaseEpoch"`, `"discovery"`, `"pending"`} {
		if !strings.Contains(out, want) {
			t.Errorf("join-requests list lacks %s:\n%s", want, out)
		}
	}
	if _, errOut, code := run(t, e, "", bc, "join-requests", "approve", id1, "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "900",
		"--reason", "rack B7 intake, ticket 4411"); code != 0 {
		t.Fatalf("approve: %s", errOut)
	}
	if _, errOut, code := run(t, e, "", bc, "join-requests", "reject", id2, "--tenant", env["TENANT"], "--pool", env["POOL"], "--reason", "unknown serial"); code != 0 {
		t.Fatalf("reject: %s", errOut)
	}

	// The waiting daemons finish on their own.
	if code := approved.exited(t, 60*time.Second); code != 0 {
		t.Fatalf("the approved bcd join exited %d:\n%s", code, approved.output())
	}
	if !strings.Contains(approved.output(), "joined as node_") {
		t.Fatalf("the approved bcd join did not report its node:\n%s", approved.output())
	}
	if code := rejected.exited(t, 60*time.Second); code == 0 || !strings.Contains(rejected.output(), id2) || !strings.Contains(rejected.output(), "rejected") {
		t.Fatalf("the rejected bcd join exited %d:\n%s", code, rejected.output())
	}
	if _, _, code := run(t, nil, "", bcd, "status", "--config", ramdiskConf); code != 0 {
		t.Fatal("bcd status after the approved join failed")
	}
	out, _, _ = run(t, e, "", bc, "join-requests", "list", "--tenant", env["TENANT"], "--pool", env["POOL"], "--state", "all", "--json")
	if !strings.Contains(out, `"consumed"`) || !strings.Contains(out, `"rejected"`) {
		t.Fatalf("after the decisions, join-requests list --state all:\n%s", out)
	}
	out, _, _ = run(t, e, "", bc, "events", "list", "--tenant", env["TENANT"], "--json")
	for _, want := range []string{"security.join-request.created", "security.join-request.approved", "security.join-request.rejected", "node.joined"} {
		if !strings.Contains(out, want) {
			t.Errorf("event %s missing from the stream", want)
		}
	}
}

var waitingRE = regexp.MustCompile(`join request (jreq_[0-9a-z]+) is waiting for approval`)

// waitingRequest waits for a bcd join to say it waits on a join request
// and returns the request's id.
func waitingRequest(t *testing.T, p *proc) string {
	t.Helper()
	var id string
	waitFor(t, "bcd to say it waits for approval", 60*time.Second, func() bool {
		if m := waitingRE.FindStringSubmatch(p.output()); m != nil {
			id = m[1]
		}
		return id != ""
	})
	return id
}

// startDev runs better-compute dev on data with args, waits until it wrote
// file and its gateway listens, and returns dev.env.
func startDev(t *testing.T, bc, data, file string, args ...string) map[string]string {
	t.Helper()
	dev := start(t, nil, bc, append([]string{"dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"}, args...)...)
	waitFor(t, "dev to write "+filepath.Base(file), 60*time.Second, func() bool {
		_, err := os.Stat(file)
		return err == nil && strings.Contains(dev.output(), "gateway listening")
	})
	return readEnv(t, filepath.Join(data, "dev.env"))
}
