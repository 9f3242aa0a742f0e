package systemd

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/better-compute/better-compute/internal/cli"
	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/gateway"
)

// unit is a parsed unit file: section -> key -> values in file order
// (a key may repeat, e.g. LoadCredential).
type unit map[string]map[string][]string

func (u unit) get(t *testing.T, section, key string) string {
	t.Helper()
	v := u[section][key]
	if len(v) == 0 {
		t.Fatalf("[%s] %s= is missing", section, key)
	}
	return v[len(v)-1]
}

// parseUnit reads the subset of systemd's unit syntax the units use:
// [Section] headers, Key=Value lines, # and ; comments. Anything else
// (a line continuation, a key outside a section) is an error, so the test
// never silently skips a line systemd would read.
func parseUnit(t *testing.T, path string) unit {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	u := unit{}
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(b))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || line[0] == '#' || line[0] == ';':
			continue
		case strings.HasSuffix(line, `\`):
			t.Fatalf("%s:%d: line continuations are not supported here", path, n)
		case line[0] == '[' && line[len(line)-1] == ']':
			section = line[1 : len(line)-1]
			u[section] = map[string][]string{}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || section == "" || strings.TrimSpace(k) == "" {
			t.Fatalf("%s:%d: want Key=Value inside a section, got %q", path, n, line)
		}
		k = strings.TrimSpace(k)
		u[section][k] = append(u[section][k], strings.TrimSpace(v))
	}
	return u
}

func seconds(t *testing.T, v string) time.Duration {
	t.Helper()
	if n, err := strconv.Atoi(v); err == nil {
		return time.Duration(n) * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		t.Fatalf("time span %q: %v", v, err)
	}
	return d
}

// drain is how long serve and gateway wait for requests in flight after
// SIGTERM (server.Run, gateway shutdownGrace): TimeoutStopSec must exceed
// it, or systemd kills a replica in the middle of its drain.
const drain = 15 * time.Second

const binary = "/usr/local/bin/better-compute"

var units = []struct {
	file, subcommand string
}{
	{"better-compute.service", "serve"},
	{"better-compute-gateway.service", "gateway"},
}

// Every unit: the hardening and restart policy of a production unit, and an
// ExecStart that the CLI itself accepts (a renamed subcommand or flag fails
// here, not on a production host).
func TestUnits(t *testing.T) {
	for _, c := range units {
		t.Run(c.file, func(t *testing.T) {
			u := parseUnit(t, c.file)
			for _, kv := range [][2]string{
				{"Restart", "on-failure"},
				{"NoNewPrivileges", "yes"},
				{"ProtectSystem", "strict"},
				{"ProtectHome", "yes"},
				{"PrivateTmp", "yes"},
				{"KillSignal", "SIGTERM"},
			} {
				if got := u.get(t, "Service", kv[0]); got != kv[1] {
					t.Errorf("%s=%s, want %s", kv[0], got, kv[1])
				}
			}
			if d := seconds(t, u.get(t, "Service", "TimeoutStopSec")); d <= drain {
				t.Errorf("TimeoutStopSec=%v must be longer than the %v drain", d, drain)
			}
			if u["Service"]["User"] == nil && u["Service"]["DynamicUser"] == nil {
				t.Error("runs as root: set User= or DynamicUser=yes")
			}
			if got := u.get(t, "Install", "WantedBy"); got != "multi-user.target" {
				t.Errorf("WantedBy=%s", got)
			}

			args := strings.Fields(u.get(t, "Service", "ExecStart"))
			if len(args) < 2 || args[0] != binary || args[1] != c.subcommand {
				t.Fatalf("ExecStart=%q, want %s %s …", args, binary, c.subcommand)
			}
			// --help after the unit's own arguments: cobra parses every
			// flag (an unknown one is an error) and resolves the
			// subcommand before it prints the help, and runs nothing.
			var out, errOut bytes.Buffer
			code := cli.Main(context.Background(), append(args[1:], "--help"), cli.Env{
				Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errOut, Getenv: func(string) string { return "" },
			})
			if code != 0 {
				t.Fatalf("better-compute %s --help: exit %d: %s", strings.Join(args[1:], " "), code, errOut.String())
			}
			if want := "better-compute " + c.subcommand + " --config"; !strings.Contains(out.String(), want) {
				t.Fatalf("help does not show %q:\n%s", want, out.String())
			}
		})
	}
}

// serve: the secret comes from an EnvironmentFile (serve reads only
// $BETTER_COMPUTE_SECRET), and everything the example config writes lies in
// the StateDirectory, the one writable place under ProtectSystem=strict.
func TestServeUnit(t *testing.T) {
	u := parseUnit(t, "better-compute.service")
	if got := u.get(t, "Service", "EnvironmentFile"); got != "/etc/better-compute/secret.env" {
		t.Errorf("EnvironmentFile=%s", got)
	}
	if got := u.get(t, "Service", "User"); got != "better-compute" {
		t.Errorf("User=%s", got)
	}
	sysusers, err := os.ReadFile("better-compute.sysusers")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(sysusers), "\nu better-compute ") {
		t.Errorf("better-compute.sysusers does not create the user better-compute:\n%s", sysusers)
	}
	state := "/var/lib/" + u.get(t, "Service", "StateDirectory") + "/"
	cfg, err := server.ParseConfig([]byte(server.Example))
	if err != nil {
		t.Fatalf("serve --print-config does not parse: %v", err)
	}
	for key, p := range map[string]string{"store.path": cfg.Store.Path, "pki.dir": cfg.PKI.Dir, "downloads.dir": cfg.Downloads.Dir} {
		if !strings.HasPrefix(p, state) {
			t.Errorf("the example config's %s = %q is outside the StateDirectory %s: read-only under ProtectSystem=strict", key, p, state)
		}
	}
	if !strings.Contains(server.Example, "--config "+strings.Fields(u.get(t, "Service", "ExecStart"))[3]) {
		t.Errorf("ExecStart's --config is not the path serve --print-config names")
	}
}

// gateway: enough descriptors for max_sessions, the capability for :443,
// and the credentials its documented config reads, which must be a config
// the gateway accepts.
func TestGatewayUnit(t *testing.T) {
	const name = "better-compute-gateway.service"
	u := parseUnit(t, name)
	n, err := strconv.Atoi(u.get(t, "Service", "LimitNOFILE"))
	if err != nil {
		t.Fatalf("LimitNOFILE: %v", err)
	}
	if need := gateway.DefaultMaxSessions + gateway.DefaultMaxConcurrent + 1024; n < need {
		t.Errorf("LimitNOFILE=%d < %d: max_sessions (%d) sessions and max_concurrent (%d) calls need a descriptor each", n, need, gateway.DefaultMaxSessions, gateway.DefaultMaxConcurrent)
	}
	if got := u.get(t, "Service", "AmbientCapabilities"); got != "CAP_NET_BIND_SERVICE" {
		t.Errorf("AmbientCapabilities=%s", got)
	}
	creds := map[string]bool{}
	for _, v := range u["Service"]["LoadCredential"] {
		id, _, _ := strings.Cut(v, ":")
		creds["/run/credentials/"+name+"/"+id] = true
	}
	// The config shown in the unit's header comment: "#   key = value".
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	var conf strings.Builder
	conf.WriteString("api_url = \"https://api.internal:8444\"\n")
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "#   "); ok && strings.Contains(rest, " = ") {
			conf.WriteString(rest + "\n")
			_, v, _ := strings.Cut(rest, " = ")
			if p, err := strconv.Unquote(v); err != nil || !creds[p] {
				t.Errorf("the config line %q names no LoadCredential of the unit (%v)", rest, creds)
			}
		}
	}
	cfg, err := gateway.ParseConfig([]byte(conf.String()))
	if err != nil {
		t.Fatalf("the config in the unit's comment: %v\n%s", err, conf.String())
	}
	if cfg.CertFile == "" || cfg.KeyFile == "" || cfg.APICAFile == "" {
		t.Fatalf("the comment's config lacks a file: %+v", cfg)
	}
}

// systemd's own check, where it is installed: unknown keys, bad values,
// and (with ExecStart pointed at an executable) the command line.
func TestSystemdAnalyzeVerify(t *testing.T) {
	sa := tools.Need(t, "systemd-analyze", "systemd's own check of the units")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	var paths []string
	for _, c := range units {
		b, err := os.ReadFile(c.file)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, c.file)
		if err := os.WriteFile(p, bytes.ReplaceAll(b, []byte(binary+" "), []byte(self+" ")), 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	out, err := exec.Command(sa, append([]string{"verify"}, paths...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
	// verify exits 0 on unknown keys and only warns: any line about our
	// files is a failure.
	for _, line := range strings.Split(string(out), "\n") {
		for _, c := range units {
			if strings.Contains(line, c.file) {
				t.Errorf("systemd-analyze verify: %s", line)
			}
		}
	}
}
