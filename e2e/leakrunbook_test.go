package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
)

// R21.1, R21.2, R21.3: the leak-response runbook of docs/operations/rotate-keys.md,
// run as written against real serve, a real gateway and five real bcd run
// on one-minute certificates. The three keys daemons pin rotate through
// prepare, activate and retire back to back (retire refuses while daemons
// are behind, naming them, and goes through with --force); the node CA is
// prepared and activated at once and retired once pki status shows no
// node behind (retire refuses before); a prepared join-signing key is then
// rolled back. Every daemon keeps renewing and holds its session, pki
// status reaches 0 behind for every key, and each daemon ends on the new
// keys only, with the retired and rolled-back ones kept as retired.
func TestLeakRunbookBackToBack(t *testing.T) {
	if testing.Short() {
		t.Skip("five daemons through back-to-back rotations of every key (about three minutes)")
	}
	const daemons = 5
	p := startRotationPlane(t, 60)
	_, bcd := binaries(t)
	tok := p.cli("join-tokens", "create", "--tenant", p.tenant, "--pool", p.pool, "--ttl", "1h", "--max-uses", fmt.Sprint(daemons))["token"].(string)
	type daemon struct{ conf, data string }
	var ds []daemon
	for i := range daemons {
		sb := newBCDIn(t, p.dir, fmt.Sprintf("leak-%d", i), p.gwURL, p.site, p.pins)
		sys, data := filepath.Join(p.dir, fmt.Sprintf("sys-leak-%d", i)), filepath.Join(p.dir, fmt.Sprintf("data-leak-%d", i))
		fakeSysfs(t, sys, fmt.Sprintf("LK-%04d", i), fmt.Sprintf("c1a57e00-0000-4000-8000-%012d", 500+i), fmt.Sprintf("3c:ec:ef:00:50:%02x", i))
		if out, errOut, code := run(t, nil, tok+"\n", bcd, "join", "--config", sb.Conf, "--data-dir", data, "--sysfs-root", sys); code != 0 {
			t.Fatalf("bcd join %d: %s\n%s", i, out, errOut)
		}
		ds = append(ds, daemon{sb.Conf, data})
		start(t, nil, bcd, "run", "--config", sb.Conf, "--data-dir", data)
	}
	waitFor(t, "every daemon's session", 30*time.Second, func() bool { return p.connected(t) == daemons })
	serials := func() []string {
		var out []string
		for _, d := range ds {
			stdout, _, code := run(t, nil, "", bcd, "status", "--json", "--config", d.conf, "--data-dir", d.data)
			if code != 0 {
				return nil
			}
			out = append(out, fmt.Sprint(jsonOf(t, stdout)["serial"]))
		}
		return out
	}
	// renewedTwice waits until every daemon renewed twice since before:
	// the first renewal may have been answered before a phase.
	renewedTwice := func(what string) {
		t.Helper()
		first := serials()
		var second []string
		waitFor(t, what+": every daemon renewed", 3*time.Minute, func() bool {
			now := serials()
			if len(now) != daemons {
				return false
			}
			if second == nil {
				for i := range now {
					if now[i] == first[i] {
						return false
					}
				}
				second = now
				return false
			}
			for i := range now {
				if now[i] == second[i] {
					return false
				}
			}
			return true
		})
	}
	retire := func(kind string, force bool) (string, int) {
		args := []string{"pki", "rotate", kind, "--phase", "retire", "--config", p.conf}
		if force {
			args = append(args, "--force")
		}
		_, errOut, code := run(t, p.secretEnv, "", p.bc, args...)
		return errOut, code
	}

	// The runbook: each key daemons pin, all three phases at once.
	pinned := []string{"serving-ca", "join-signing", "join-encryption"}
	for _, k := range pinned {
		p.pki(t, "rotate", k, "--phase", "prepare")
		if k == "serving-ca" {
			p.pki(t, "ca-file", "--out", p.gwCA)
		}
		p.pki(t, "rotate", k, "--phase", "activate")
		if k == "serving-ca" {
			p.reissue(t)
		}
		errOut, code := retire(k, false)
		if code == 0 || !strings.Contains(errOut, "INVALID_STATE") || !strings.Contains(errOut, "behind") || !strings.Contains(errOut, "--force") {
			t.Fatalf("%s retire with daemons behind: exit %d, %s", k, code, errOut)
		}
		if errOut, code := retire(k, true); code != 0 {
			t.Fatalf("%s retire --force: %s", k, errOut)
		}
		if k == "serving-ca" {
			p.pki(t, "ca-file", "--out", p.gwCA)
		}
	}
	// The node CA: prepared and activated at once, retired once no node
	// presents a certificate of the old one.
	p.pki(t, "rotate", "node-ca", "--phase", "prepare")
	p.pki(t, "rotate", "node-ca", "--phase", "activate")
	if errOut, code := retire("node-ca", false); code == 0 || !strings.Contains(errOut, "behind") {
		t.Fatalf("node-ca retire with nodes behind: exit %d, %s", code, errOut)
	}
	renewedTwice("after the back-to-back rotations")
	waitFor(t, "pki status: no node behind", 2*time.Minute, func() bool {
		for _, n := range p.behind(t) {
			if n != 0 {
				return false
			}
		}
		return true
	})
	if errOut, code := retire("node-ca", false); code != 0 {
		t.Fatalf("node-ca retire with every node caught up: %s", errOut)
	}
	// A prepared join-signing key rolled back.
	rolledBack := jsonOf(t, p.pki(t, "rotate", "join-signing", "--phase", "prepare", "--json"))["fingerprint"].(string)
	p.pki(t, "rotate", "join-signing", "--phase", "rollback")
	renewedTwice("after the node-ca retire and the rollback")
	waitFor(t, "every daemon's session after the rotations", time.Minute, func() bool { return p.connected(t) == daemons })

	final := jsonOf(t, p.pki(t, "pins", "--json"))
	for _, d := range ds {
		cfg, err := bcdconfig.Load(d.conf)
		must(t, err)
		for kind, key := range map[string]string{"serving-ca": "servingCaPins", "join-signing": "joinSigningKeyPins", "join-encryption": "joinEncryptionKeyPins"} {
			var want []string
			for _, p := range final[key].([]any) {
				want = append(want, p.(string))
			}
			if got := cfg.PinSet(kind); !slices.Equal(got, want) {
				t.Errorf("%s: %s pins %v, want the keys in force %v", d.conf, kind, got, want)
			}
		}
		for _, old := range []string{p.pins["servingCaPin"].(string), p.pins["joinSigningKeyPin"].(string), p.pins["joinEncryptionKeyPin"].(string), rolledBack} {
			if !slices.Contains(cfg.RetiredPins, old) {
				t.Errorf("%s: retired_pins lacks %s", d.conf, old)
			}
		}
	}
}
