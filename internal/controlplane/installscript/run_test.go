package installscript

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// fakeBCD is the "bcd" the test server hands out: it records its arguments,
// standard input and environment under $BCD_FAKE_LOG and exits 0.
func fakeBCD(tag string) []byte {
	return []byte(`#!/bin/sh
# fake bcd ` + tag + `
log=${BCD_FAKE_LOG:?}
printf '%s\n' "$@" >"$log/args"
cat >"$log/stdin"
env >"$log/env"
exit 0
`)
}

// downloads serves builds by path and records what was asked.
type downloads struct {
	mu    sync.Mutex
	files map[string][]byte
	asked []string
}

func (d *downloads) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	d.asked = append(d.asked, r.URL.Path)
	b, ok := d.files[r.URL.Path]
	d.mu.Unlock()
	if !ok {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Write(b)
}

// scriptRun is one run of a generated script against a throwaway root.
type scriptRun struct {
	t      *testing.T
	root   string // BCD_ROOT
	log    string // BCD_FAKE_LOG
	script string
	env    []string
	// shell, when set, runs the script instead of testShell (argv).
	shell []string
	// onStart, when set, is called with the shell's pid (the script's $$)
	// once it has started.
	onStart func(pid int)
}

type runResult struct {
	code   int
	stderr string
}

func (r *scriptRun) run(stdin string, useStdin bool, args ...string) runResult {
	r.t.Helper()
	argv := []string{testShell(r.t)}
	if len(r.shell) > 0 {
		argv = r.shell
	}
	cmd := exec.Command(argv[0], append(append(argv[1:], r.script), args...)...)
	cmd.Env = append([]string{
		"PATH=" + os.Getenv("PATH"),
		"BCD_ROOT=" + r.root,
		"BCD_ALLOW_HTTP=1",
		"BCD_FAKE_LOG=" + r.log,
		"TMPDIR=" + r.t.TempDir(),
	}, r.env...)
	if useStdin {
		cmd.Stdin = strings.NewReader(stdin) // a pipe, not a terminal
	} // else /dev/null
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Start()
	if err == nil {
		if r.onStart != nil {
			r.onStart(cmd.Process.Pid)
		}
		err = cmd.Wait()
	}
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		r.t.Fatalf("run: %v", err)
	}
	if testing.Verbose() {
		r.t.Logf("exit %d:\n%s%s", code, stdout.String(), stderr.String())
	}
	return runResult{code: code, stderr: stdout.String() + stderr.String()}
}

func newToken(t testing.TB) string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "bcjt_" + ids.New(ids.JoinToken, time.Now()) + "." + base64.RawURLEncoding.EncodeToString(b)
}

// files lists every path under root, relative, sorted by Walk.
func files(t testing.TB, root string) []string {
	var out []string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		if p != root {
			rel, _ := filepath.Rel(root, p)
			out = append(out, rel)
		}
		return nil
	})
	return out
}

func readFile(t testing.TB, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func mode(t testing.TB, p string) fs.FileMode {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

// setup serves v1 of the fake bcd and returns params for it (http allowed).
func setup(t *testing.T) (*downloads, *httptest.Server, Params) {
	d := &downloads{files: map[string][]byte{}}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	p := validParams(t)
	p.allowHTTP = true
	p.BaseURL = srv.URL
	p.BasePath = "/api/compute"
	bin := fakeBCD("v1")
	for _, a := range Arches {
		d.files["/api/compute/downloads/bcd/0.1.0/linux-"+a] = bin
	}
	p.SHA256 = map[string]string{"amd64": sum(bin), "arm64": sum(bin)}
	return d, srv, p
}

func newRun(t *testing.T, p Params) *scriptRun {
	t.Helper()
	out, err := Generate(p)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r := &scriptRun{t: t, root: filepath.Join(dir, "root"), log: filepath.Join(dir, "log"), script: filepath.Join(dir, "install-bcd.sh")}
	for _, d := range []string{r.root, r.log} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(r.script, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return r
}

func (r *scriptRun) nothingInstalled() {
	r.t.Helper()
	if f := files(r.t, r.root); len(f) != 0 {
		r.t.Fatalf("installed %v", f)
	}
	if f := files(r.t, r.log); len(f) != 0 {
		r.t.Fatalf("bcd ran: %v", f)
	}
}

// R11.2, R11.5: the script takes the token only from BCD_JOIN_TOKEN or
// standard input, refuses anything else, and never shows it.
func TestInstallScriptRefusesBadTokens(t *testing.T) {
	d, _, p := setup(t)
	good := newToken(t)
	cases := []struct {
		name  string
		stdin string
		env   []string
		args  []string
		want  string
	}{
		{"not a token", "hello-world-secret\n", nil, nil, "not a join token"},
		{"api key", "bck_" + strings.Repeat("a", 40) + "\n", nil, nil, "not a join token"},
		{"short secret", "bcjt_jt_abc.tooshort\n", nil, nil, "not a join token"},
		{"long secret", good + "A\n", nil, nil, "not a join token"},
		{"two dots", good + ".x\n", nil, nil, "not a join token"},
		{"upper id", strings.Replace(good, "bcjt_jt_", "bcjt_jt_A", 1) + "\n", nil, nil, "not a join token"},
		{"bad env", "", []string{"BCD_JOIN_TOKEN=bcjt_jt_x.$(id)"}, nil, "not a join token"},
		{"argument", "", nil, []string{good}, "the token is never taken as an argument: pass it on standard input or in BCD_JOIN_TOKEN"},
		{"argument with stdin", good + "\n", nil, []string{"--token", good}, "never taken as an argument"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRun(t, p)
			r.env = c.env
			res := r.run(c.stdin, true, c.args...)
			if res.code == 0 || !strings.Contains(res.stderr, c.want) {
				t.Fatalf("exit %d, output %q; want a refusal with %q", res.code, res.stderr, c.want)
			}
			// SECURITY: the input is never echoed.
			secretPart := c.stdin
			if c.args != nil {
				secretPart = good
			} else if c.env != nil {
				secretPart = strings.TrimPrefix(c.env[0], "BCD_JOIN_TOKEN=")
			}
			if s := strings.TrimSpace(secretPart); s != "" && strings.Contains(res.stderr, s[5:]) {
				t.Fatalf("the output shows the token: %q", res.stderr)
			}
			r.nothingInstalled()
		})
	}
	if len(d.asked) != 0 {
		t.Fatalf("downloaded on a refused token: %v", d.asked)
	}
}

// R11.5: a download that does not match its SHA-256 stops the script before
// anything is installed.
func TestInstallScriptWrongSHA256(t *testing.T) {
	d, _, p := setup(t)
	for k := range d.files {
		d.files[k] = append(d.files[k], []byte("# tampered\n")...)
	}
	r := newRun(t, p)
	res := r.run(newToken(t)+"\n", true)
	if res.code == 0 || !strings.Contains(res.stderr, "does not match its SHA-256") || !strings.Contains(res.stderr, "nothing was installed") {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	r.nothingInstalled()
	if len(d.asked) != 1 {
		t.Fatalf("asked %v", d.asked)
	}
}

// R11.5: plain http only with the BCD_ALLOW_HTTP test hook; a missing build
// stops the script too.
func TestInstallScriptDownloadRefusals(t *testing.T) {
	d, _, p := setup(t)
	r := newRun(t, p)
	r.env = []string{"BCD_ALLOW_HTTP=0"}
	if res := r.run(newToken(t)+"\n", true); res.code == 0 || !strings.Contains(res.stderr, "refusing to download over http") {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	r.nothingInstalled()

	clear(d.files)
	r = newRun(t, p)
	if res := r.run(newToken(t)+"\n", true); res.code == 0 || !strings.Contains(res.stderr, "could not download") {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	r.nothingInstalled()
}

// R11.5: without a token and without config.toml there is nothing to do.
func TestInstallScriptNoTokenNoConfig(t *testing.T) {
	d, _, p := setup(t)
	r := newRun(t, p)
	res := r.run("", false)
	if res.code == 0 || !strings.Contains(res.stderr, "no join token and no") {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	r.nothingInstalled()
	if len(d.asked) != 0 {
		t.Fatalf("asked %v", d.asked)
	}
}

// R11.1, R11.2, R11.5: a join installs bcd, config.toml, join-encryption.jwk
// and bcd.service, and hands the token to `bcd join` on standard input only.
// Without a token the same host is then upgraded in place.
func TestInstallScriptJoinThenUpgrade(t *testing.T) {
	for _, via := range []string{"stdin", "env"} {
		t.Run(via, func(t *testing.T) {
			d, _, p := setup(t)
			p.GatewayServerName = "gw.internal.example.com"
			r := newRun(t, p)
			token := newToken(t)
			var res runResult
			if via == "env" {
				r.env = []string{"BCD_JOIN_TOKEN=" + token}
				res = r.run("", false)
			} else {
				res = r.run("  "+token+"\r\n", true)
			}
			if res.code != 0 {
				t.Fatalf("exit %d: %s", res.code, res.stderr)
			}
			if strings.Contains(res.stderr, token[5:]) {
				t.Fatalf("the output shows the token: %s", res.stderr)
			}
			if !strings.Contains(res.stderr, "would run: systemctl daemon-reload && systemctl enable --now bcd.service") {
				t.Fatalf("no systemctl notice: %s", res.stderr)
			}

			cfgPath := filepath.Join(r.root, "etc/bcd/config.toml")
			// The fake bcd saw `join --config …/etc/bcd/config.toml` (and,
			// under BCD_ROOT, the data directory there) and the token on
			// stdin, never in argv or its environment.
			if got, want := readFile(t, filepath.Join(r.log, "args")), "join\n--config\n"+cfgPath+"\n--data-dir\n"+filepath.Join(r.root, "var/lib/bcd")+"\n"; got != want {
				t.Fatalf("bcd args %q, want %q", got, want)
			}
			if got := readFile(t, filepath.Join(r.log, "stdin")); got != token+"\n" {
				t.Fatalf("bcd stdin %q", got)
			}
			if env := readFile(t, filepath.Join(r.log, "env")); strings.Contains(env, token[5:]) || strings.Contains(env, "BCD_JOIN_TOKEN") {
				t.Fatalf("the token reached bcd's environment")
			}

			// config.toml is what bcd reads (R11.1).
			cfg, err := bcdconfig.Load(cfgPath)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.GatewayURL != p.GatewayURL || cfg.GatewayServerName != p.GatewayServerName || cfg.Site != p.Site ||
				cfg.ServingCASPKIPin != p.Pins.ServingCA || cfg.JoinSigningKeyPin != p.Pins.JoinSigning || cfg.JoinEncryptionKeyPin != p.Pins.JoinEncryption {
				t.Fatalf("config %+v", cfg)
			}
			key, found, err := bcdconfig.LoadEncryptionKey(filepath.Dir(cfgPath), cfg.JoinEncryptionKeyPin)
			if err != nil || !found || !key.Equal(p.EncryptionKey) {
				t.Fatalf("join-encryption.jwk: %v %v", found, err)
			}
			unit := readFile(t, filepath.Join(r.root, "etc/systemd/system/bcd.service"))
			for _, want := range []string{"Type=notify\n", "ExecStart=/usr/local/bin/bcd run --config /etc/bcd/config.toml\n", "Restart=always\n", "RestartPreventExitStatus=3\n", "WantedBy=multi-user.target\n"} {
				if !strings.Contains(unit, want) {
					t.Fatalf("bcd.service lacks %q:\n%s", want, unit)
				}
			}
			bin := filepath.Join(r.root, "usr/local/bin/bcd")
			if got := readFile(t, bin); got != string(fakeBCD("v1")) {
				t.Fatalf("bcd binary %q", got)
			}
			for path, want := range map[string]fs.FileMode{
				bin: 0o755, cfgPath: 0o644, filepath.Join(r.root, "etc/bcd/join-encryption.jwk"): 0o644,
				filepath.Join(r.root, "etc/systemd/system/bcd.service"): 0o644, filepath.Join(r.root, "var/lib/bcd"): 0o700,
			} {
				if got := mode(t, path); got != want {
					t.Errorf("%s: mode %o, want %o", path, got, want)
				}
			}
			for _, f := range files(t, r.root) {
				if strings.Contains(f, "install-bcd") || strings.HasPrefix(filepath.Base(f), ".") {
					t.Errorf("left behind %s", f)
				}
				if st, err := os.Stat(filepath.Join(r.root, f)); err == nil && st.Mode().IsRegular() && strings.Contains(readFile(t, filepath.Join(r.root, f)), token[5:]) {
					t.Errorf("the token was written to %s", f)
				}
			}

			// Upgrade in place: a new version, no token (stdin /dev/null).
			v2 := fakeBCD("v2")
			p2 := p
			p2.Version = "0.2.0"
			p2.SHA256 = map[string]string{"amd64": sum(v2), "arm64": sum(v2)}
			for _, a := range Arches {
				d.files["/api/compute/downloads/bcd/0.2.0/linux-"+a] = v2
			}
			out, err := Generate(p2)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(r.script, out, 0o644); err != nil {
				t.Fatal(err)
			}
			for _, f := range []string{"args", "stdin", "env"} {
				os.Remove(filepath.Join(r.log, f))
			}
			os.WriteFile(cfgPath, []byte("site = \""+p.Site+"\"\n# stale\n"), 0o644)
			r.env = nil
			res = r.run("", false)
			if res.code != 0 {
				t.Fatalf("upgrade: exit %d: %s", res.code, res.stderr)
			}
			if !strings.Contains(res.stderr, "upgraded bcd to 0.2.0") || !strings.Contains(res.stderr, "would run: systemctl daemon-reload && systemctl restart bcd.service") {
				t.Fatalf("upgrade output: %s", res.stderr)
			}
			if got := readFile(t, bin); got != string(v2) {
				t.Fatalf("binary not replaced: %q", got)
			}
			if f := files(t, r.log); len(f) != 0 {
				t.Fatalf("bcd ran during the upgrade: %v", f)
			}
			if _, err := bcdconfig.Load(cfgPath); err != nil {
				t.Fatalf("config not rewritten: %v", err)
			}
		})
	}
}

// A host configured for another site is left alone.
func TestInstallScriptOtherSite(t *testing.T) {
	d, _, p := setup(t)
	r := newRun(t, p)
	etc := filepath.Join(r.root, "etc/bcd")
	os.MkdirAll(etc, 0o755)
	other := "site = \"" + ids.New(ids.Site, time.Now()) + "\"\n"
	os.WriteFile(filepath.Join(etc, "config.toml"), []byte(other), 0o644)
	for _, stdin := range []string{"", newToken(t) + "\n"} {
		res := r.run(stdin, stdin != "")
		if res.code == 0 || !strings.Contains(res.stderr, "nothing was changed") {
			t.Fatalf("exit %d: %s", res.code, res.stderr)
		}
		if got := readFile(t, filepath.Join(etc, "config.toml")); got != other {
			t.Fatalf("config changed: %q", got)
		}
	}
	if len(d.asked) != 0 {
		t.Fatalf("asked %v", d.asked)
	}
}

// wgets lists the wget implementations on this machine: GNU wget and
// BusyBox's (the one small images have). In CI (.ci/run installs both) a
// missing one fails the test instead of skipping it, so the wget path is
// tested for real there.
func wgets(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for name, argv := range map[string][]string{"GNU wget": {"wget"}, "busybox wget": {"busybox", "wget"}} {
		p, ok := tools.Want(t, argv[0], "the install script's download with "+name)
		if !ok {
			continue
		}
		if name == "GNU wget" {
			// Debian may point wget at busybox; this one must be GNU's.
			if v, err := exec.Command(p, "--version").Output(); err != nil || !strings.Contains(string(v), "GNU Wget") {
				continue
			}
		}
		out[name] = append([]string{p}, argv[1:]...)
	}
	if len(out) == 0 {
		t.Skip("SKIPPING: no wget")
	}
	return out
}

// wgetOnly returns a PATH with the tools the script uses and a wget that
// records its arguments in log and runs argv, but no curl.
func wgetOnly(t *testing.T, argv []string, log string) string {
	t.Helper()
	bin := t.TempDir()
	for _, tool := range []string{"id", "uname", "mktemp", "rm", "sha256sum", "cut", "mkdir", "chmod", "cp", "mv", "sed", "cat", "env", "printf"} {
		p := tools.Need(t, tool, "the install script runs it")
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	wrapper := "#!/bin/sh\nprintf '%s\\n' \"$*\" >>" + Quote(log) + "\nexec"
	for _, a := range argv {
		wrapper += " " + Quote(a)
	}
	wrapper += " \"$@\"\n"
	if err := os.WriteFile(filepath.Join(bin, "wget"), []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin
}

// R11.5: without curl the script downloads with wget (GNU's or BusyBox's),
// checks the SHA-256 and installs; a failed download and a wrong SHA-256
// install nothing.
func TestInstallScriptWget(t *testing.T) {
	for name, argv := range wgets(t) {
		t.Run(name, func(t *testing.T) {
			d, _, p := setup(t)
			calls := filepath.Join(t.TempDir(), "wget-calls")
			path := "PATH=" + wgetOnly(t, argv, calls)
			url := p.BaseURL + "/api/compute/downloads/bcd/0.1.0/linux-"

			r := newRun(t, p)
			r.env = []string{path}
			res := r.run(newToken(t)+"\n", true)
			if res.code != 0 {
				t.Fatalf("exit %d: %s", res.code, res.stderr)
			}
			if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(fakeBCD("v1")) {
				t.Fatalf("binary %q", got)
			}
			// One download, after the script asked wget which it is
			// (--help); GNU wget's follows no redirect.
			downloads := 0
			for _, call := range strings.Split(strings.TrimSuffix(readFile(t, calls), "\n"), "\n") {
				switch {
				case call == "--help":
				case strings.Contains(call, url) && (name != "GNU wget" || strings.Contains(call, "--max-redirect=0")):
					downloads++
				default:
					t.Fatalf("wget call %q", call)
				}
			}
			if downloads != 1 {
				t.Fatalf("%d wget downloads, want one for %s…", downloads, url)
			}

			// A build that is not there: wget fails, nothing is installed.
			for k := range d.files {
				delete(d.files, k)
			}
			r = newRun(t, p)
			r.env = []string{path}
			if res := r.run(newToken(t)+"\n", true); res.code == 0 || !strings.Contains(res.stderr, "could not download") || !strings.Contains(res.stderr, "nothing was installed") {
				t.Fatalf("missing build: exit %d: %s", res.code, res.stderr)
			}
			r.nothingInstalled()

			// A build that does not match its SHA-256.
			for _, a := range Arches {
				d.files["/api/compute/downloads/bcd/0.1.0/linux-"+a] = []byte("#!/bin/sh\nexit 0\n")
			}
			r = newRun(t, p)
			r.env = []string{path}
			if res := r.run(newToken(t)+"\n", true); res.code == 0 || !strings.Contains(res.stderr, "does not match its SHA-256") {
				t.Fatalf("wrong build: exit %d: %s", res.code, res.stderr)
			}
			r.nothingInstalled()
		})
	}
}
