package bcdcmd

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/fakemachine"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// R4.3, R6.1: bcd fake-machine writes a machine that bcd join --sysfs-root
// claims exactly, and says what its hardware key is.
func TestFakeMachineJoin(t *testing.T) {
	h := newHost(t, true)
	sys := filepath.Join(h.root, "fake-sys")
	const uuid, mac = "4c4c4544-0042-3510-8053-b7c04f5a3132", "3c:ec:ef:aa:bb:01"
	r := h.run("", true, "fake-machine", "--out", sys, "--serial", "SN-7701", "--product-uuid", uuid, "--mac", mac)
	want(t, "R4.3", r, 0, "stdout", "wrote a fake machine to "+sys+"\n", "product uuid:    "+uuid, "product serial:  SN-7701", "macs:            "+mac,
		"hardware key:    ", "trusted, from the product UUID and serials: a NIC or GPU swap keeps it",
		"bcd join --config bc-dev/bcd/config.toml --sysfs-root "+sys+" < join-token")

	r = h.run(h.srv.Token+"\n", false, "join", "--config", h.cfgPath, "--sysfs-root", sys)
	want(t, "R4.3", r, 0, "stderr", "joined as node_")
	c := h.srv.JoinService.LastRequest().GetClaims()
	if c.GetProductUuid() != uuid || c.GetProductSerial() != "SN-7701" || strings.Join(c.GetMacs(), ",") != mac || c.GetBoardSerial() != "" || len(c.GetGpuUuids()) != 0 {
		t.Fatalf("R4.3 claims sent: %v", c)
	}
}

// bcd fake-machine: defaults, placeholders, swaps, GPUs, JSON, refusals.
func TestFakeMachine(t *testing.T) {
	h := newHost(t, false)
	dir := t.TempDir()
	sys := filepath.Join(dir, "sys")

	// Defaults: a random product UUID and one random permanent MAC.
	var c hwid.Claims
	r := h.run("", true, "fake-machine", "--out", sys, "--serial", "SN-1", "--json")
	want(t, "", r, 0, "stdout")
	if err := json.Unmarshal([]byte(r.stdout), &c); err != nil {
		t.Fatalf("--json: %v %q", err, r.stdout)
	}
	k, err := hwid.KeyOf(c)
	if err != nil || !k.Stable || len(c.MACs) != 1 || c.ProductSerial != "SN-1" || hwid.IsPlaceholderUUID(c.ProductUUID) {
		t.Fatalf("defaults: %+v %+v %v", c, k, err)
	}

	// R6.3: the same board with another NIC keeps its key; the JSON is
	// what Collect reads.
	r = h.run("", true, "fake-machine", "--out", sys, "--serial", "SN-1", "--product-uuid", c.ProductUUID, "--mac", "3c:ec:ef:00:00:09", "--json")
	var swapped hwid.Claims
	if err := json.Unmarshal([]byte(r.stdout), &swapped); err != nil || r.code != 0 {
		t.Fatalf("swap: %v %q %q", err, r.stdout, r.stderr)
	}
	k2, _ := hwid.KeyOf(swapped)
	if strings.Join(swapped.MACs, ",") != "3c:ec:ef:00:00:09" || k2.Hash != k.Hash {
		t.Fatalf("R6.3 swap: %+v, key %s -> %s", swapped, k, k2)
	}

	// R6.2: placeholder firmware is written as such, and said to be.
	r = h.run("", true, "fake-machine", "--out", sys, "--serial", "To Be Filled By O.E.M.", "--product-uuid", "03000200-0400-0500-0006-000700080009")
	want(t, "R6.2", r, 0, "stdout", "product serial:  To Be Filled By O.E.M.", "needs an --expect-* binding (placeholder-hardware)")

	// A serial and MACs only: trusted, but named by its NICs too.
	r = h.run("", true, "fake-machine", "--out", sys, "--serial", "SN-2", "--product-uuid", "00000000-0000-0000-0000-000000000000", "--mac", "3c:ec:ef:00:00:01")
	want(t, "R6.3", r, 0, "stdout", "trusted, from every identifier: a NIC or GPU swap makes a new machine")

	// GPUs go to --procfs-out, and join reads them with --procfs-root.
	proc := filepath.Join(dir, "proc")
	r = h.run("", true, "fake-machine", "--out", sys, "--serial", "SN-3", "--gpu-uuid", "GPU-8f0c1d2e-aaaa", "--procfs-out", proc)
	want(t, "", r, 0, "stdout", "gpu uuids:       GPU-8f0c1d2e-aaaa", "--sysfs-root "+sys+" --procfs-root "+proc+" < join-token")
	if _, err := os.Stat(filepath.Join(proc, fakemachine.Marker)); err != nil {
		t.Fatal(err)
	}

	// Refusals name the flag, and never touch a directory bcd did not write.
	if err := os.WriteFile(filepath.Join(dir, "notes"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--serial", "S"}, "Error: INVALID_ARGUMENT: --out: required"},
		{[]string{"--out", sys}, "Error: INVALID_ARGUMENT: --serial: required"},
		{[]string{"--out", sys, "--serial", "S", "--mac", "nope"}, `Error: INVALID_ARGUMENT: --mac: "nope" is not a MAC`},
		{[]string{"--out", sys, "--serial", "S\x07"}, "Error: INVALID_ARGUMENT: --serial: bcd join would refuse this machine's claims (claims-control-char)"},
		{[]string{"--out", sys, "--serial", "S", "--gpu-uuid", "GPU-1"}, "Error: INVALID_ARGUMENT: --procfs-out: required with --gpu-uuid"},
		{[]string{"--out", dir, "--serial", "S"}, "Error: ALREADY_EXISTS: " + dir + " is not empty and was not written by bcd fake-machine"},
		{[]string{"--out", sys, "--serial", "S", "extra"}, "Error: INVALID_ARGUMENT: bcd fake-machine takes no arguments"},
	} {
		r := h.run("", true, append([]string{"fake-machine"}, tc.args...)...)
		want(t, "", r, 1, "stderr", tc.want)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "notes")); string(b) != "x" {
		t.Fatal("a foreign directory was changed")
	}
}

// `bcd status --config FILE` with no FILE fails instead of answering for
// the default data directory; `bcd run --data-dir` is the identity run
// uses.
func TestStatusMissingConfigAndRunDataDir(t *testing.T) {
	h := newHost(t, true)
	missing := filepath.Join(h.root, "nonexistent.toml")
	r := h.run("", true, "status", "--config", missing)
	want(t, "R11.4", r, 1, "stderr", "Error: INVALID_CONFIG: no bcd config at "+missing+": name the config bcd joined with (--config), or its identity directory (--data-dir)\n")
	if r.stdout != "" {
		t.Fatalf("stdout: %q", r.stdout)
	}
	// --data-dir alone still answers without a config.
	r = h.run("", true, "status", "--config", missing, "--data-dir", filepath.Join(h.root, "elsewhere"))
	want(t, "R11.4", r, 1, "stdout", "not joined: no identity in "+filepath.Join(h.root, "elsewhere"))

	// Joined under the config's data_dir; run with another --data-dir
	// looks there, and finds nothing.
	r = h.run(h.srv.Token+"\n", false, "join", "--config", h.cfgPath)
	want(t, "", r, 0, "stderr", "joined as node_")
	other := filepath.Join(h.root, "other-data")
	r = h.run("", true, "run", "--config", h.cfgPath, "--data-dir", other)
	want(t, "", r, 1, "stderr", "Error: INVALID_STATE: "+other+": this machine has not joined")
	// A relative --data-dir is made absolute.
	r = h.run("", true, "run", "--config", h.cfgPath, "--data-dir", "relative-data")
	wd, _ := os.Getwd()
	want(t, "", r, 1, "stderr", "Error: INVALID_STATE: "+filepath.Join(wd, "relative-data")+": this machine has not joined")
	r = h.run("", true, "run", "--config", missing)
	want(t, "", r, 1, "stderr", "Error: INVALID_CONFIG: no bcd config at "+missing)
}
