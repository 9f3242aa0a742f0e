package cli_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// R24.1: dev --config FILE applies serve's options over dev's own, so any
// of them can be tried on a laptop (here [limits] max_body_bytes, whose
// effect a CLI call shows), checks them as serve does, and refuses the
// ones dev decides itself.
func TestDevConfigOverlayR24_1(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	devArgs := func(conf string) []string {
		return []string{"dev", "--data-dir", filepath.Join(dir, "refused"), "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0", "--config", conf}
	}
	run(t, nil, devArgs(write("bad.toml", "[join]\nsvid_form = \"bogus\"\n"))...).fails(t, "INVALID_CONFIG", "svid_form")
	run(t, nil, devArgs(write("unknown.toml", "[join]\nsvid_from = \"spiffe-strict\"\n"))...).fails(t, "INVALID_CONFIG", "unknown keys: join.svid_from")
	run(t, nil, devArgs(write("owned.toml", "[store]\npath = \"/tmp/x.db\"\n"))...).fails(t, "INVALID_ARGUMENT", "sets store, which dev decides itself")

	d := startDev(t, "--config", write("dev.toml", "[join]\nsvid_form = \"spiffe-strict\"\n[limits]\nmax_body_bytes = 64\n"))
	r := d.cli(t, "join-tokens", "create", "--tenant", d.env["TENANT"], "--pool", d.env["POOL"], "--ttl", "1h",
		"--expect-serial", strings.Repeat("S", 40), "--key", "overlay-"+strings.Repeat("k", 40))
	if r.code == 0 || !strings.Contains(r.stderr, "larger than configured max 64") {
		t.Fatalf("a request larger than the overlay's max_body_bytes: %d %s; want it refused by that limit", r.code, r.stderr)
	}
}
