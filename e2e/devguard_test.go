package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// devBannerRE captures the API's and the gateway's addresses from dev's
// banner.
var devBannerRE = regexp.MustCompile(`better-compute dev is running at https?://([^/\s]+)\S* .*\ngateway for daemons: https://([^;\s]+);`)

// R24.1: a second dev on a data directory in use refuses and names the
// running one; a dev on the same ports says another dev is probably
// running; and dev refuses a non-empty directory it did not make instead
// of writing over its files.
func TestDevGuardsItsDirectoryR24_1(t *testing.T) {
	bc, _ := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	first := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	var api, gw string
	waitFor(t, "the first dev's banner", 60*time.Second, func() bool {
		m := devBannerRE.FindStringSubmatch(first.output())
		if m == nil {
			return false
		}
		api, gw = m[1], m[2]
		return true
	})
	envBefore := readFile(t, filepath.Join(data, "dev.env"))

	_, errOut, code := run(t, nil, "", bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	pid := strconv.Itoa(first.cmd.Process.Pid)
	if code == 0 || !strings.Contains(errOut, "CONFLICT: another better-compute dev is running on "+data) || !strings.Contains(errOut, "pid "+pid) || !strings.Contains(errOut, api) {
		t.Fatalf("a second dev on the same directory: exit %d, %s; want CONFLICT naming pid %s and %s", code, errOut, pid, api)
	}
	if got := readFile(t, filepath.Join(data, "dev.env")); got != envBefore {
		t.Fatal("the refused dev rewrote dev.env")
	}

	_, errOut, code = run(t, nil, "", bc, "dev", "--data-dir", filepath.Join(dir, "other"), "--listen", "127.0.0.1:0", "--gateway-listen", gw)
	if code == 0 || !strings.Contains(errOut, "another better-compute dev is probably running") {
		t.Fatalf("a dev on the first one's gateway port: exit %d, %s", code, errOut)
	}

	mine := filepath.Join(dir, "mine")
	must(t, os.MkdirAll(mine, 0o700))
	must(t, os.WriteFile(filepath.Join(mine, "gateway.key"), []byte("my key\n"), 0o600))
	_, errOut, code = run(t, nil, "", bc, "dev", "--data-dir", mine, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	if code == 0 || !regexp.MustCompile(`INVALID_ARGUMENT: .*not a better-compute dev data directory`).MatchString(errOut) {
		t.Fatalf("dev on a directory it did not make: exit %d, %s", code, errOut)
	}
	if got := readFile(t, filepath.Join(mine, "gateway.key")); got != "my key\n" {
		t.Fatalf("dev wrote over gateway.key: %q", got)
	}

	// Once the first dev stops, the directory is free again.
	_ = first.cmd.Process.Signal(os.Interrupt)
	first.exited(t, 30*time.Second)
	again := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	waitFor(t, "dev again on the freed directory", 60*time.Second, func() bool {
		return strings.Contains(again.output(), "better-compute dev is running")
	})

	// The restart replaced the site and ramdisk token files and revoked
	// the tokens they held: one live token of each role, not two.
	env := readEnv(t, filepath.Join(data, "dev.env"))
	out, errOut, code := run(t, envList(env), "", bc, "join-tokens", "list", "--tenant", env["TENANT"], "--pool", env["POOL"], "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	live := map[string]int{}
	items, _ := jsonOf(t, out)["items"].([]any)
	for _, it := range items {
		tok := it.(map[string]any)
		if tok["state"] == "live" {
			role, _ := tok["role"].(string)
			live[role]++
		}
	}
	if live["site"] != 1 || live["ramdisk"] != 1 {
		t.Fatalf("live tokens by role after a restart: %v, want one site and one ramdisk token\n%s", live, out)
	}
}

// R24.1: an exported BETTER_COMPUTE_SECRET (as a production install has)
// does not break dev: dev keeps its own secret in DIR/dev-secret, says the
// variable is not used, and starts again on the same directory whatever
// the variable holds.
func TestDevIgnoresAnExportedSecretR24_1(t *testing.T) {
	bc, _ := binaries(t)
	data := filepath.Join(t.TempDir(), "bc-dev")
	for i, secret := range []string{"production-secret-one-0123456789-abcdefghijkl", "production-secret-two-0123456789-abcdefghijkl"} {
		dev := start(t, []string{"BETTER_COMPUTE_SECRET=" + secret}, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
		waitFor(t, "dev's banner", 60*time.Second, func() bool {
			return strings.Contains(dev.output(), "better-compute dev is running") || strings.Contains(dev.output(), "Error:")
		})
		if out := dev.output(); !strings.Contains(out, "better-compute dev is running") || !strings.Contains(out, "BETTER_COMPUTE_SECRET is set but not used") {
			t.Fatalf("start %d with BETTER_COMPUTE_SECRET exported:\n%s", i+1, out)
		}
		_ = dev.cmd.Process.Signal(os.Interrupt)
		dev.exited(t, 30*time.Second)
	}

	// backup --data-dir authenticates under the directory's own secret
	// too, so a restore with dev's secret opens the archive.
	prod := []string{"BETTER_COMPUTE_SECRET=production-secret-one-0123456789-abcdefghijkl"}
	archive := filepath.Join(filepath.Dir(data), "dev.backup")
	if _, errOut, code := run(t, prod, "", bc, "backup", "--data-dir", data, "--out", archive); code != 0 {
		t.Fatalf("backup with BETTER_COMPUTE_SECRET exported: %s", errOut)
	}
	own := []string{"BETTER_COMPUTE_SECRET=" + strings.TrimSpace(readFile(t, filepath.Join(data, "dev-secret")))}
	if _, errOut, code := run(t, own, "", bc, "restore", "--in", archive, "--data-dir", filepath.Join(filepath.Dir(data), "restored")); code != 0 {
		t.Fatalf("restore with dev's secret: %s", errOut)
	}
}
