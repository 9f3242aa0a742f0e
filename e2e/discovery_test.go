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
	s := startDiscoverySite(t)
	bc, bcd, dir, env, e, ramdiskConf, agentID := s.bc, s.bcd, s.dir, s.env, s.e, s.ramdiskConf, s.agentID
	var out, errOut string
	var code int

	// The boot module's word on two machines, then their ramdisks join.
	// Every daemon of the test reaches dev's gateway from loopback, and a
	// ramdisk is admitted only from the address its site vouched for
	// (R10.4), so the boots are on 127.0.0.1.
	const mac1, mac2 = "00:1b:21:0a:0b:0c", "00:1b:21:0a:0b:0d"
	s.vouch(t, mac1, loopback)
	s.vouch(t, mac2, loopback)
	sys2 := filepath.Join(dir, "sys-2")
	fakeSysfs(t, sys2, "PXE-8", "4c4c4544-0042-3510-8052-c7c04f5a0008", mac2)
	approved := s.ramdisk(t, "--boot-mac", mac1, "--boot-ip", loopback)
	rejected := s.ramdisk(t, "--boot-mac", mac2, "--boot-ip", loopback, "--data-dir", filepath.Join(dir, "ramdisk-2"), "--sysfs-root", sys2)

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

// R15.3, R10.4 with real processes: the take-over a holder of the ramdisk
// token can try. Machine Y is a node of dev's pool, its bcd run holding a
// session; the site booted machine X and vouched for it. A bcd whose fake
// machine has Y's product UUID and serial and X's MAC (bcd fake-machine)
// joins with the ramdisk token as X's ramdisk: it waits on a join request
// instead of reclaiming Y, and Y's node keeps its generation, its
// certificate and its session. X's own ramdisk is admitted on the vouch
// (approved), and then an approval of the forged request admits nothing:
// the vouch admitted X (vouch-used). A ramdisk whose vouched address is not
// the one it connects from is refused (vouch-peer).
func TestDiscoveryTakeoverRefused(t *testing.T) {
	s := startDiscoverySite(t)
	tenant, pool := s.env["TENANT"], s.env["POOL"]
	const yUUID, ySerial, yMAC = "4c4c4544-0042-3510-8052-c7c04f5a0a01", "SN-Y-0001", "3c:ec:ef:0a:00:01"
	const xMAC = "00:1b:21:0a:0b:0c" // dev's network-booted machine (bc-dev/ramdisk)
	fake := func(dir, mac string) {
		if _, errOut, code := run(t, nil, "", s.bcd, "fake-machine", "--out", dir, "--serial", ySerial, "--product-uuid", yUUID, "--mac", mac); code != 0 {
			t.Fatalf("bcd fake-machine: %s", errOut)
		}
	}

	// Y: a node of the pool, joined with a node token, its session up.
	sysY := filepath.Join(s.dir, "sys-y")
	fake(sysY, yMAC)
	tokFile := filepath.Join(s.dir, "token-y")
	if _, errOut, code := run(t, s.e, "", s.bc, "join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--out", tokFile); code != 0 {
		t.Fatalf("join-tokens create: %s", errOut)
	}
	tok, err := os.ReadFile(tokFile)
	must(t, err)
	yConf := filepath.Join(s.data, "bcd", "config.toml")
	out, errOut, code := run(t, nil, string(tok), s.bcd, "join", "--config", yConf, "--sysfs-root", sysY, "--json")
	if code != 0 {
		t.Fatalf("Y's bcd join: %s %s", out, errOut)
	}
	y := nodeIDOf(t, out)
	yRun := start(t, nil, s.bcd, "run", "--config", yConf)
	yNode := func() map[string]any {
		out, errOut, code := run(t, s.e, "", s.bc, "nodes", "get", y, "--tenant", tenant, "--json")
		if code != 0 {
			t.Fatalf("nodes get %s: %s", y, errOut)
		}
		return jsonOf(t, out)
	}
	waitFor(t, "Y's session", 30*time.Second, func() bool { return yNode()["connection"] == "connected" })
	untouched := func(when string) {
		t.Helper()
		n := yNode()
		certs, _ := n["certs"].([]any)
		if n["identityGeneration"] != float64(1) || len(certs) != 1 || certs[0].(map[string]any)["revokedAt"] != nil || n["connection"] != "connected" {
			t.Fatalf("%s: Y's node changed: %v", when, n)
		}
		select {
		case <-yRun.done:
			t.Fatalf("%s: Y's bcd run exited:\n%s", when, yRun.output())
		default:
		}
	}

	// The forged ramdisk, from the vouched address: it waits for a person.
	s.vouch(t, xMAC, loopback)
	sysForged := filepath.Join(s.dir, "sys-forged")
	fake(sysForged, xMAC)
	forged := s.ramdisk(t, "--boot-mac", xMAC, "--boot-ip", loopback, "--sysfs-root", sysForged, "--data-dir", filepath.Join(s.dir, "forged"))
	forgedReq := waitingRequest(t, forged)
	untouched("while the forged ramdisk waits")

	approve := func(id string, extra ...string) {
		t.Helper()
		args := append([]string{"join-requests", "approve", id, "--tenant", tenant, "--pool", pool, "--ttl", "900", "--reason", "e2e"}, extra...)
		if _, errOut, code := run(t, s.e, "", s.bc, args...); code != 0 {
			t.Fatalf("approve %s: %s", id, errOut)
		}
	}
	// R22.2: the forged request names the node it would take, and a bare
	// approval of it is refused.
	shown, _, code := run(t, s.e, "", s.bc, "join-requests", "show", forgedReq, "--tenant", tenant, "--pool", pool)
	if code != 0 || !strings.Contains(shown, "RECLAIM "+y) || !strings.Contains(shown, "evidence: vouched by") {
		t.Fatalf("join-requests show %s:\n%s", forgedReq, shown)
	}
	if _, errOut, code := run(t, s.e, "", s.bc, "join-requests", "approve", forgedReq, "--tenant", tenant, "--pool", pool, "--ttl", "900", "--reason", "e2e"); code == 0 ||
		!strings.Contains(errOut, "reclaims node "+y) {
		t.Fatalf("a bare approval of the forged request: exit %d, %s; want refused naming %s", code, errOut, y)
	}
	untouched("after a bare approval of the forged request")
	// X's own ramdisk (an unknown machine: it waits too) is approved and
	// joins on the vouch.
	x := s.ramdisk(t, "--boot-mac", xMAC, "--boot-ip", loopback)
	approve(waitingRequest(t, x))
	if code := x.exited(t, 60*time.Second); code != 0 || !strings.Contains(x.output(), "joined as node_") || strings.Contains(x.output(), y) {
		t.Fatalf("X's ramdisk exited %d:\n%s", code, x.output())
	}
	// A person approves the forged request too, acknowledging the
	// reclaim: the vouch admitted X.
	approve(forgedReq, "--reclaim", y)
	if code := forged.exited(t, 60*time.Second); code == 0 || strings.Contains(forged.output(), "joined as") {
		t.Fatalf("the forged ramdisk exited %d:\n%s", code, forged.output())
	}
	s.refused(t, "discovery:vouch-used")
	untouched("after the forged request was approved")

	// A boot vouched for at 10.0.0.9 whose ramdisk connects from loopback.
	const zMAC = "00:1b:21:0a:0b:0e"
	s.vouch(t, zMAC, "10.0.0.9")
	sysZ := filepath.Join(s.dir, "sys-z")
	fakeSysfs(t, sysZ, "PXE-9", "4c4c4544-0042-3510-8052-c7c04f5a0009", zMAC)
	z := s.ramdisk(t, "--boot-mac", zMAC, "--boot-ip", "10.0.0.9", "--sysfs-root", sysZ, "--data-dir", filepath.Join(s.dir, "ramdisk-z"))
	if code := z.exited(t, 60*time.Second); code == 0 {
		t.Fatalf("the ramdisk from another address joined:\n%s", z.output())
	}
	s.refused(t, "discovery:vouch-peer")
}

// refused waits for a security.join.refused event with reason in dev's
// tenant.
func (s *discoverySite) refused(t *testing.T, reason string) {
	t.Helper()
	waitFor(t, "a refusal "+reason, 30*time.Second, func() bool {
		out, _, _ := run(t, s.e, "", s.bc, "events", "list", "--tenant", s.env["TENANT"], "--type", "security.join.refused", "--json")
		return strings.Contains(out, `"`+reason+`"`)
	})
}

// loopback is where every daemon of an e2e test reaches dev's gateway
// from, so the boots its site vouches for are there.
const loopback = "127.0.0.1"

// discoverySite is better-compute dev with its site agent joined and
// running (bcd join --role site, bcd run).
type discoverySite struct {
	bc, bcd, dir, data    string
	env                   map[string]string
	e                     []string
	siteConf, ramdiskConf string
	agentID               string
}

func startDiscoverySite(t *testing.T) *discoverySite {
	t.Helper()
	s := &discoverySite{dir: t.TempDir()}
	s.bc, s.bcd = binaries(t)
	s.data = filepath.Join(s.dir, "bc-dev")
	s.siteConf = filepath.Join(s.data, "site", "config.toml")
	s.ramdiskConf = filepath.Join(s.data, "ramdisk", "config.toml")
	s.env = startDev(t, s.bc, s.data, s.ramdiskConf)
	s.e = envList(s.env)
	out, errOut, code := run(t, nil, s.secret(t, "site.token"), s.bcd, "join", "--config", s.siteConf, "--role", "site", "--json")
	if code != 0 {
		t.Fatalf("site agent join: %s %s", out, errOut)
	}
	s.agentID = nodeIDOf(t, out)
	start(t, nil, s.bcd, "run", "--config", s.siteConf)
	return s
}

// nodeIDOf is the node id in bcd join --json's output.
func nodeIDOf(t *testing.T, out string) string {
	t.Helper()
	joined := jsonOf(t, out)
	id, _ := joined["node_id"].(string)
	if id == "" {
		id, _ = joined["nodeId"].(string)
	}
	if !strings.HasPrefix(id, "node_") {
		t.Fatalf("bcd join --json printed no node id: %s", out)
	}
	return id
}

// secret reads one of the tokens dev minted as the site module, checking
// it is a 0600 file (R2.7).
func (s *discoverySite) secret(t *testing.T, name string) string {
	t.Helper()
	path := filepath.Join(s.data, "secrets", name)
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret %s: %v %v, want a 0600 file (R2.7)", path, st, err)
	}
	b, err := os.ReadFile(path)
	must(t, err)
	return string(b)
}

// vouch is the boot module's word on a boot of mac at ip (lease epoch 1),
// through the running site agent; it waits until the vouch is recorded.
func (s *discoverySite) vouch(t *testing.T, mac, ip string) {
	t.Helper()
	if _, errOut, code := run(t, nil, "", s.bcd, "site", "vouch", "--config", s.siteConf, "--mac", mac, "--ip", ip, "--lease-epoch", "1"); code != 0 {
		t.Fatalf("bcd site vouch: %s", errOut)
	}
	waitFor(t, "the site agent's vouch for "+mac, 30*time.Second, func() bool {
		out, _, _ := run(t, s.e, "", s.bc, "events", "list", "--tenant", s.env["TENANT"], "--type", "site.machines-vouched", "--json")
		return strings.Contains(out, mac)
	})
}

// ramdisk starts a network-booted machine's bcd join with the site's
// ramdisk token (lease epoch 1).
func (s *discoverySite) ramdisk(t *testing.T, args ...string) *proc {
	t.Helper()
	return start(t, []string{"BCD_JOIN_TOKEN=" + strings.TrimSpace(s.secret(t, "ramdisk.token"))}, s.bcd, append([]string{"join", "--config", s.ramdiskConf,
		"--attestor", "discovery", "--role", "ramdisk", "--boot-lease-epoch", "1"}, args...)...)
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
