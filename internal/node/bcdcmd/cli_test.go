package bcdcmd

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tokeninput"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// host is a machine with bcd installed: config.toml and
// join-encryption.jwk under root/etc/bcd, pointing at a fake gateway.
type host struct {
	t       *testing.T
	srv     *enrolltest.Server
	root    string
	cfg     *bcdconfig.Config
	cfgPath string
	environ map[string]string
}

func newHost(t *testing.T, installed bool) *host {
	t.Helper()
	srv := enrolltest.New(t, enrolltest.Options{})
	root := t.TempDir()
	h := &host{t: t, srv: srv, root: root, cfg: srv.Config(t, root),
		cfgPath: filepath.Join(root, "etc", "bcd", "config.toml"), environ: map[string]string{}}
	if installed {
		if err := h.cfg.Write(h.cfgPath); err != nil {
			t.Fatal(err)
		}
		srv.WriteKeyFile(t, filepath.Dir(h.cfgPath))
	}
	return h
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs bcd with stdin ("" with terminal: a terminal).
func (h *host) run(stdin string, terminal bool, args ...string) result {
	h.t.Helper()
	var out, errOut strings.Builder
	code := Main(context.Background(), args, Env{
		Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errOut,
		LookupEnv:       func(k string) (string, bool) { v, ok := h.environ[k]; return v, ok },
		Unsetenv:        func(k string) error { delete(h.environ, k); return nil },
		StdinIsTerminal: func() bool { return terminal },
		Clock:           clock.NewFake(h.srv.Now),
		HTTPClient:      h.srv.HTTPClient,
	})
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

func (h *host) cfgFlag() []string { return []string{"--config", h.cfgPath} }

func (h *host) status(args ...string) result {
	return h.run("", true, append([]string{"status", "--config", h.cfgPath}, args...)...)
}

func want(t *testing.T, req string, r result, code int, stream string, subs ...string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("%s: exit %d, want %d\nstdout: %s\nstderr: %s", req, r.code, code, r.stdout, r.stderr)
	}
	text := r.stderr
	if stream == "stdout" {
		text = r.stdout
	}
	for _, s := range subs {
		if !strings.Contains(text, s) {
			t.Errorf("%s: %s %q lacks %q", req, stream, text, s)
		}
	}
}

// R11.2, R11.4, R4.6: join from standard input, then status.
func TestJoinAndStatus(t *testing.T) {
	h := newHost(t, true)
	r := h.run(h.srv.Token+"\n", false, append([]string{"join"}, h.cfgFlag()...)...)
	want(t, "R11.2", r, 0, "stderr", "collecting hardware claims…\n", "sealing the token…\n", "joining through 127.0.0.1:",
		"joined as node_", "(spiffe://compute.example.com/site/"+h.srv.Site+"/node/node_", "certificate valid until ")
	if strings.Contains(r.stderr+r.stdout, h.srv.Token) {
		t.Fatal("R11.2: the token was printed")
	}
	st, err := os.Stat(filepath.Join(h.cfg.DataDir, identity.KeyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("R4.1: node.key %v %v", st, err)
	}

	s := h.status()
	want(t, "R11.4", s, 0, "stdout", "node:", "SPIFFE ID:", "spiffe://compute.example.com/site/", "role:       node",
		"serial:", "valid for 24h0m0s", "key:        software", "attestor:   join-token")

	var js Status
	s = h.status("--json")
	if err := json.Unmarshal([]byte(s.stdout), &js); err != nil || s.code != 0 {
		t.Fatalf("status --json: %v %q", err, s.stdout)
	}
	if !js.Joined || js.Expired || js.Role != pki.RoleNode || js.SiteID != h.srv.Site || js.KeyKind != identity.KindSoftware ||
		!strings.HasPrefix(js.NodeID, "node_") || js.DataDir != h.cfg.DataDir {
		t.Fatalf("status --json: %+v", js)
	}

	// R11.4: already joined.
	r = h.run(enrolltest.NewToken(h.srv.Now), false, append([]string{"join"}, h.cfgFlag()...)...)
	want(t, "R11.4", r, 1, "stderr", "Error: INVALID_STATE: already joined as "+js.NodeID, "bcd join --reset --yes")
	if h.srv.JoinService.Calls() != 1 {
		t.Fatal("R11.4: the second join reached the gateway")
	}
}

// R11.4: --reset needs --yes; --reset --yes moves aside, then joins with the
// token, or only resets without one.
func TestReset(t *testing.T) {
	h := newHost(t, true)
	join := append([]string{"join"}, h.cfgFlag()...)
	if r := h.run(h.srv.Token, false, join...); r.code != 0 {
		t.Fatal(r.stderr)
	}
	before := h.status("--json").stdout

	r := h.run(h.srv.Token, false, append(join, "--reset")...)
	want(t, "R11.4", r, 1, "stderr", "Error: INVALID_ARGUMENT: --reset moves this machine's identity aside", "bcd join --reset --yes")
	if h.status("--json").stdout != before {
		t.Fatal("R11.4: --reset without --yes changed the identity")
	}
	r = h.run("", true, append(join, "--yes")...)
	want(t, "R11.4", r, 1, "stderr", "--yes only confirms --reset")

	r = h.run(h.srv.Token, false, append(join, "--reset", "--yes", "--json")...)
	want(t, "R11.4", r, 0, "stderr", "moved the old identity aside to "+filepath.Join(h.cfg.DataDir, "reset-"), "joined as node_")
	var js Status
	if err := json.Unmarshal([]byte(r.stdout), &js); err != nil || !js.Joined {
		t.Fatalf("join --json: %v %q", err, r.stdout)
	}
	if strings.Contains(before, js.NodeID) {
		t.Fatal("R11.4: the new join kept the old node")
	}

	// Without a token, --reset --yes only resets.
	r = h.run("", true, append(join, "--reset", "--yes")...)
	want(t, "R11.4", r, 0, "stderr", "moved the old identity aside", "now join with a new token")
	s := h.status()
	want(t, "R11.4", s, 1, "stdout", "not joined: no identity in "+h.cfg.DataDir)
	r = h.run("", false, append(join, "--reset", "--yes")...) // empty, non-terminal stdin
	want(t, "R11.4", r, 0, "stderr", "nothing to reset")
}

// R11.2: where the token may come from.
func TestTokenInput(t *testing.T) {
	t.Run("argument", func(t *testing.T) {
		h := newHost(t, true)
		r := h.run("", true, append([]string{"join", h.srv.Token}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "Error: INVALID_ARGUMENT: never pass the join token as an argument", "standard input", "revoke")
		if strings.Contains(r.stderr, h.srv.Token) || h.srv.JoinService.Calls() != 0 {
			t.Fatal("R11.2: the token was echoed or used")
		}
		r = h.run("", true, append([]string{"join", "bcjt_jt_x.y"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "never pass the join token as an argument")
		r = h.run("", true, append([]string{"join", "now"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "INVALID_ARGUMENT: bcd join takes no arguments")
	})
	t.Run("none", func(t *testing.T) {
		h := newHost(t, true)
		r := h.run("", true, append([]string{"join"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "Error: INVALID_ARGUMENT: no join token: pipe it on standard input")
	})
	t.Run("not a token on stdin", func(t *testing.T) {
		h := newHost(t, true)
		r := h.run("hunter2\n", false, append([]string{"join"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "INVALID_ARGUMENT: not a join token")
	})
	t.Run("environment", func(t *testing.T) {
		h := newHost(t, true)
		h.environ[tokeninput.EnvVar] = h.srv.Token
		r := h.run("", true, append([]string{"join"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 0, "stderr", "joined as")
		if _, ok := h.environ[tokeninput.EnvVar]; ok {
			t.Error("R11.2: BCD_JOIN_TOKEN is still set")
		}
	})
	t.Run("token file", func(t *testing.T) {
		h := newHost(t, true)
		p := filepath.Join(t.TempDir(), "token")
		if err := os.WriteFile(p, []byte(h.srv.Token+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		r := h.run("", true, append([]string{"join", "--token-file", p}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 0, "stderr", "joined as")
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("R11.2: the token file is still there: %v", err)
		}
	})
	t.Run("token file and environment", func(t *testing.T) {
		h := newHost(t, true)
		h.environ[tokeninput.EnvVar] = h.srv.Token
		p := filepath.Join(t.TempDir(), "token")
		if err := os.WriteFile(p, []byte(h.srv.Token), 0o600); err != nil {
			t.Fatal(err)
		}
		r := h.run("", true, append([]string{"join", "--token-file", p}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "give the token one way")
	})
	t.Run("token file readable by others", func(t *testing.T) {
		h := newHost(t, true)
		p := filepath.Join(t.TempDir(), "token")
		if err := os.WriteFile(p, []byte(h.srv.Token), 0o644); err != nil {
			t.Fatal(err)
		}
		r := h.run("", true, append([]string{"join", "--token-file", p, "--reset", "--yes"}, h.cfgFlag()...)...)
		want(t, "R11.2", r, 1, "stderr", "mode 0644")
		if strings.Contains(r.stderr, "moved") {
			t.Error("R11.4: reset before the token was read")
		}
	})
}

// R4.7: a refusal is shown as such.
func TestJoinRefused(t *testing.T) {
	h := newHost(t, true)
	r := h.run(enrolltest.NewToken(h.srv.Now), false, append([]string{"join"}, h.cfgFlag()...)...)
	want(t, "R4.7", r, 1, "stderr", "Error: ACCESS_DENIED: Join refused")
	h.srv.JoinService.Fail(errs.New(errs.Conflict, "This machine joined concurrently; retry"))
	r = h.run(h.srv.Token, false, append([]string{"join"}, h.cfgFlag()...)...)
	want(t, "R4.8", r, 1, "stderr", "Error: CONFLICT: This machine joined concurrently; retry")
	want(t, "R11.4", h.status(), 1, "stdout", "not joined")
}

// R11.3: a host without config.toml joins with --server and the pins, and
// writes config.toml and join-encryption.jwk.
func TestHostBuild(t *testing.T) {
	h := newHost(t, false)
	args := []string{"join", "--config", h.cfgPath, "--server", h.srv.URL, "--site", h.srv.Site,
		"--serving-ca-pin", h.srv.Pins.ServingCA, "--join-signing-pin", h.srv.Pins.JoinSigning,
		"--join-encryption-pin", h.srv.Pins.JoinEncryption,
		"--data-dir", h.cfg.DataDir, "--sysfs-root", h.cfg.SysfsRoot, "--procfs-root", h.cfg.ProcfsRoot}
	r := h.run(h.srv.Token, false, args...)
	want(t, "R11.3", r, 0, "stderr", "joined as")
	got, err := bcdconfig.Load(h.cfgPath)
	if err != nil || got.GatewayURL != h.srv.URL || got.Site != h.srv.Site || got.DataDir != h.cfg.DataDir ||
		got.SysfsRoot != h.cfg.SysfsRoot {
		t.Fatalf("R11.3: %v %+v", err, got)
	}
	if _, found, err := bcdconfig.LoadEncryptionKey(filepath.Dir(h.cfgPath), h.srv.Pins.JoinEncryption); !found || err != nil {
		t.Fatalf("R11.3: join-encryption.jwk: %v %v", found, err)
	}
	want(t, "R11.3", h.status(), 0, "stdout", "node:")

	// Another host: pins that differ from the document are refused.
	h2 := newHost(t, false)
	args2 := []string{"join", "--config", h2.cfgPath, "--server", h2.srv.URL, "--site", h2.srv.Site,
		"--serving-ca-pin", h2.srv.Pins.JoinSigning, "--join-signing-pin", h2.srv.Pins.JoinSigning,
		"--join-encryption-pin", h2.srv.Pins.JoinEncryption, "--data-dir", h2.cfg.DataDir, "--sysfs-root", h2.cfg.SysfsRoot}
	r = h2.run(h2.srv.Token, false, args2...)
	want(t, "R11.3", r, 1, "stderr", "Error: INVALID_CONFIG: refusing the well-known document", "gateway.servingCaPin differs from --serving-ca-pin")
	if _, err := os.Stat(h2.cfgPath); !errors.Is(err, fs.ErrNotExist) {
		t.Fatal("R11.3: config.toml written after a refusal")
	}

	// Without config.toml and without --server: say both ways.
	r = h2.run(h2.srv.Token, false, "join", "--config", h2.cfgPath, "--data-dir", h2.cfg.DataDir)
	want(t, "R11.3", r, 1, "stderr", "Error: INVALID_CONFIG: no bcd config at "+h2.cfgPath, "install script", "--server")
}

func TestMisc(t *testing.T) {
	h := newHost(t, true)
	r := h.run("", true, "version")
	want(t, "", r, 0, "stdout", "bcd "+version.Version+" (agent protocol ")
	r = h.run("", true, "join", "--no-such-flag")
	want(t, "", r, 1, "stderr", "Error: INVALID_ARGUMENT: unknown flag: --no-such-flag")
	r = h.run("", true, "frobnicate")
	want(t, "", r, 1, "stderr", "Error: INVALID_ARGUMENT: unknown command")
	r = h.status("--json")
	want(t, "R11.4", r, 1, "stdout", `"joined": false`)
	r = h.run("", true, "status", "--data-dir", filepath.Join(h.root, "nowhere"))
	want(t, "R11.4", r, 1, "stdout", "not joined")
	r = h.run("", true, "status", "extra")
	want(t, "", r, 1, "stderr", "Error: INVALID_ARGUMENT: bcd status takes no arguments")
	// A broken config.toml is reported with its code.
	if err := os.WriteFile(h.cfgPath, []byte("gateway = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r = h.status()
	want(t, "R11.1", r, 1, "stderr", "Error: INVALID_CONFIG: ", "unknown key gateway")
}

// R11.4: a refused bcd join --reset --yes leaves the old identity in place
// (status shows it, it loads), and says what the operator needs.
func TestResetRefusedKeepsIdentityR11_4(t *testing.T) {
	h := newHost(t, true)
	join := append([]string{"join"}, h.cfgFlag()...)
	if r := h.run(h.srv.Token, false, join...); r.code != 0 {
		t.Fatal(r.stderr)
	}
	before := h.status("--json").stdout
	var old Status
	if err := json.Unmarshal([]byte(before), &old); err != nil {
		t.Fatal(err)
	}
	r := h.run(enrolltest.NewToken(h.srv.Now), false, append(join, "--reset", "--yes")...)
	want(t, "R11.4", r, 1, "stderr",
		"Error: ACCESS_DENIED: Join refused. This machine has joined before; the control plane refuses a new key for a known machine unless the token allows it: mint a token with --allow-reclaim and run bcd join --reset --yes again. The reason is recorded in the security.join.refused event.",
		"The old identity (node "+old.NodeID+") was kept in place.")
	if strings.Contains(r.stderr, "moved the old identity aside") {
		t.Error("R11.4: the refused join moved the identity aside")
	}
	if got := h.status("--json").stdout; got != before {
		t.Fatalf("R11.4: the identity changed:\n%s\nwant\n%s", got, before)
	}
	if _, err := (&identity.Store{Dir: h.cfg.DataDir}).Load(); err != nil {
		t.Fatalf("R11.4: the old identity does not load: %v", err)
	}
}

// R11.4: doctor's advice for an expired certificate works as written: "join
// again as root: bcd join --reset --yes, then bcd join" (the first command,
// without a token, moves the identity aside; the second joins). The one
// command with the token (--reset --yes < token) works too, and keeps the
// expired identity until the new one is saved.
func TestDoctorAdviceForExpiredR11_4(t *testing.T) {
	expired := func(t *testing.T) *host {
		t.Helper()
		h := newHost(t, true)
		h.srv.JoinService.BeforeSign(func(a *enrolltest.Answer) {
			a.Params.NotBefore, a.Params.NotAfter = h.srv.Now.Add(-4*time.Minute), h.srv.Now.Add(-time.Minute)
		})
		if r := h.run(h.srv.Token, false, append([]string{"join"}, h.cfgFlag()...)...); r.code != 0 {
			t.Fatal(r.stderr)
		}
		h.srv.JoinService.BeforeSign(nil)
		d := h.doctorAt(h.srv.Now)
		want(t, "R11.4", d, 1, "stdout", "the certificate expired at ", "join again as root: bcd join --reset --yes, then bcd join")
		return h
	}
	t.Run("as written", func(t *testing.T) {
		h := expired(t)
		join := append([]string{"join"}, h.cfgFlag()...)
		r := h.run("", true, append(join, "--reset", "--yes")...)
		want(t, "R11.4", r, 0, "stderr", "moved the old identity aside to ", "now join with a new token")
		r = h.run(h.srv.Token, false, join...)
		want(t, "R11.4", r, 0, "stderr", "joined as node_")
		if d := h.doctorAt(h.srv.Now); d.code != 0 {
			t.Fatalf("R11.4: doctor after following its advice: %d\n%s", d.code, d.stdout)
		}
	})
	// R24.1: the other way the message offers, the only one for a site
	// agent (no site token to join with again), works as written.
	t.Run("by x509pop", func(t *testing.T) {
		h := expired(t)
		d := h.doctorAt(h.srv.Now)
		want(t, "R24.1", d, 1, "stdout", "re-join as the same node without a token: bcd join --attestor x509pop")
		r := h.run("", false, append(append([]string{"join"}, h.cfgFlag()...), "--attestor", "x509pop")...)
		want(t, "R24.1", r, 0, "stderr", "node_")
		if d := h.doctorAt(h.srv.Now); d.code != 0 {
			t.Fatalf("R24.1: doctor after bcd join --attestor x509pop: %d\n%s", d.code, d.stdout)
		}
		if st := h.status(); !strings.Contains(st.stdout, "valid for") {
			t.Fatalf("R24.1: status after the x509pop re-join:\n%s", st.stdout)
		}
	})
	t.Run("in one command", func(t *testing.T) {
		h := expired(t)
		r := h.run(h.srv.Token, false, append(append([]string{"join"}, h.cfgFlag()...), "--reset", "--yes")...)
		want(t, "R11.4", r, 0, "stderr", "joined as node_", "moved the old identity aside to ")
		if d := h.doctorAt(h.srv.Now); d.code != 0 {
			t.Fatalf("R11.4: doctor after the join: %d\n%s", d.code, d.stdout)
		}
	})
}
