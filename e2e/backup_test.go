package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// Backup and restore with the real binaries (R16.3): a backup of dev's data
// directory taken while it runs; one machine joins and another renews after
// it; dev runs again on the restored directory. The backup's token is
// revoked; both machines' certificates are unknown there and their
// renewals refused; a new token makes the late joiner a new node, and one
// with --allow-reclaim takes the renewed machine back as its node.
func TestBackupRestoreDev(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	dev := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	waitFor(t, "dev to write dev.env", 60*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(data, "bcd", "config.toml"))
		return err == nil && strings.Contains(dev.output(), "gateway listening")
	})
	env := readEnv(t, filepath.Join(data, "dev.env"))
	tok := token(t, bc, env, filepath.Join(dir, "tok"), "--max-uses", "3")

	a := newMachine(t, bcd, dir, "a", filepath.Join(data, "bcd"))
	aNode := a.join(t, tok)

	archive := filepath.Join(dir, "bc.backup")
	if out, errOut, code := run(t, nil, "", bc, "backup", "--data-dir", data, "--out", archive); code != 0 || !strings.Contains(errOut, "copying the database") {
		t.Fatalf("backup: %d %s %s", code, out, errOut)
	}
	b := newMachine(t, bcd, dir, "b", filepath.Join(data, "bcd"))
	bNode := b.join(t, tok)
	if out, errOut, code := run(t, nil, "", bcd, "renew", "--config", a.conf); code != 0 {
		t.Fatalf("renew after the backup: %s %s", out, errOut)
	}
	_ = dev.cmd.Process.Signal(os.Interrupt)
	dev.exited(t, 30*time.Second)

	restored := filepath.Join(dir, "restored")
	secret, err := os.ReadFile(filepath.Join(data, "dev-secret"))
	must(t, err)
	secretEnv := []string{"BETTER_COMPUTE_SECRET=" + strings.TrimSpace(string(secret))}
	// R23.2: the archive is authenticated under dev's secret.
	if out, errOut, code := run(t, nil, "", bc, "restore", "--in", archive, "--data-dir", restored); code == 0 || !strings.Contains(errOut, "BETTER_COMPUTE_SECRET is not set") {
		t.Fatalf("restore without the secret: %d %s %s", code, out, errOut)
	}
	out, errOut, code := run(t, secretEnv, "", bc, "restore", "--in", archive, "--data-dir", restored)
	if code != 0 || !regexp.MustCompile(`revoked [1-9][0-9]* join tokens`).MatchString(out) {
		t.Fatalf("restore: %d %s %s", code, out, errOut)
	}
	dev2 := start(t, secretEnv, bc, "dev", "--data-dir", restored, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	waitFor(t, "dev on the restored directory", 60*time.Second, func() bool {
		// dev writes dev.env, then the bcd config read below.
		_, err := os.Stat(filepath.Join(restored, "bcd", "config.toml"))
		return err == nil && strings.Contains(dev2.output(), "gateway listening")
	})
	env2 := readEnv(t, filepath.Join(restored, "dev.env"))
	gwURL := regexp.MustCompile(`(?m)^gateway_url = .*$`).FindString(readFile(t, filepath.Join(restored, "bcd", "config.toml")))
	a.point(t, gwURL)
	b.point(t, gwURL)

	// The backup's token: revoked.
	c := newMachine(t, bcd, dir, "c", filepath.Join(restored, "bcd"))
	c.point(t, gwURL)
	if out, errOut, code := c.try(t, tok); code == 0 {
		t.Fatalf("the backup's token joined after the restore: %s %s", out, errOut)
	}
	// Both machines that changed after the backup are unknown.
	for _, m := range []*machine{a, b} {
		if out, errOut, code := run(t, nil, "", bcd, "renew", "--config", m.conf); code == 0 {
			t.Fatalf("machine %s renewed on the restored control plane: %s %s", m.name, out, errOut)
		}
	}
	waitFor(t, "the renewals refused as cert-unknown", 20*time.Second, func() bool {
		out, _, _ := run(t, envList(env2), "", bc, "events", "list", "--tenant", env2["TENANT"], "--json")
		return strings.Count(out, "cert-unknown") >= 2
	})
	again := b.join(t, token(t, bc, env2, filepath.Join(dir, "tok-b"), "--max-uses", "1"), "--reset", "--yes")
	if again == bNode {
		t.Errorf("the late joiner is node %s again, want a new node", again)
	}
	back := a.join(t, token(t, bc, env2, filepath.Join(dir, "tok-a"), "--allow-reclaim"), "--reset", "--yes")
	if back != aNode {
		t.Errorf("the renewed machine came back as %s, want %s", back, aNode)
	}
	if out, errOut, code := run(t, nil, "", bcd, "renew", "--config", a.conf); code != 0 {
		t.Errorf("the reclaimed node's renewal: %s %s", out, errOut)
	}
}

// token mints a join token of dev's pool into file and returns it.
func token(t *testing.T, bc string, env map[string]string, file string, args ...string) string {
	t.Helper()
	args = append([]string{"join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "1h", "--out", file}, args...)
	if out, errOut, code := run(t, envList(env), "", bc, args...); code != 0 {
		t.Fatalf("create token: %s %s", out, errOut)
	}
	return readFile(t, file)
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	must(t, err)
	return string(b)
}

// machine is a fake machine with its own bcd config and data directory,
// made from dev's bcd config.
type machine struct {
	name, bcd, conf, sys string
}

var nodeIDRE = regexp.MustCompile(`joined as (node_[0-9a-z]+)`)

func newMachine(t *testing.T, bcd, dir, name, devBCD string) *machine {
	t.Helper()
	m := &machine{name: name, bcd: bcd, conf: filepath.Join(dir, name, "config.toml"), sys: filepath.Join(dir, name, "sys")}
	must(t, os.MkdirAll(filepath.Join(dir, name), 0o700))
	conf := regexp.MustCompile(`(?m)^data_dir = .*$`).ReplaceAllString(readFile(t, filepath.Join(devBCD, "config.toml")), `data_dir = "`+filepath.Join(dir, name, "data")+`"`)
	must(t, os.WriteFile(m.conf, []byte(conf), 0o600))
	jwk := readFile(t, filepath.Join(devBCD, "join-encryption.jwk"))
	must(t, os.WriteFile(filepath.Join(dir, name, "join-encryption.jwk"), []byte(jwk), 0o644))
	if out, errOut, code := run(t, nil, "", bcd, "fake-machine", "--out", m.sys, "--serial", "SN-BK-"+name); code != 0 {
		t.Fatalf("fake-machine: %s %s", out, errOut)
	}
	return m
}

// point moves the machine's config to the gateway line gw.
func (m *machine) point(t *testing.T, gw string) {
	t.Helper()
	conf := regexp.MustCompile(`(?m)^gateway_url = .*$`).ReplaceAllString(readFile(t, m.conf), gw)
	must(t, os.WriteFile(m.conf, []byte(conf), 0o600))
}

func (m *machine) try(t *testing.T, token string, args ...string) (string, string, int) {
	t.Helper()
	return run(t, nil, token, m.bcd, append([]string{"join", "--config", m.conf, "--sysfs-root", m.sys}, args...)...)
}

// join joins the machine with token and returns its node id.
func (m *machine) join(t *testing.T, token string, args ...string) string {
	t.Helper()
	out, errOut, code := m.try(t, token, args...)
	id := nodeIDRE.FindStringSubmatch(out + errOut)
	if code != 0 || id == nil {
		t.Fatalf("machine %s: bcd join: %d %s %s", m.name, code, out, errOut)
	}
	return id[1]
}
