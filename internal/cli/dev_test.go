package cli_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/cli"
	bcdcli "github.com/better-compute/better-compute/internal/node/bcdcmd"
)

// runAsBCD makes this test binary bcd when the install script runs the copy
// dev served: the script then joins with real bcd code through dev's real
// gateway.
const runAsBCD = "BC_CLI_TEST_RUN_AS_BCD"

func TestMain(m *testing.M) {
	if os.Getenv(runAsBCD) == "1" {
		os.Exit(bcdcli.Main(context.Background(), os.Args[1:], bcdcli.Env{}))
	}
	os.Exit(m.Run())
}

// syncBuffer is a bytes.Buffer safe for a writer and a poller.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// devProc is `better-compute dev` running in-process.
type devProc struct {
	out, errOut *syncBuffer
	dir         string
	env         map[string]string // dev.env, with --ca-file's variable
	banner      string
	done        chan int
	stop        context.CancelFunc
}

// startDev runs dev on ports it picks and waits for its banner.
func startDev(t *testing.T, args ...string) *devProc {
	t.Helper()
	d := &devProc{out: &syncBuffer{}, errOut: &syncBuffer{}, dir: filepath.Join(t.TempDir(), "bc-dev"), done: make(chan int, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	d.stop = cancel
	go func() {
		d.done <- cli.Main(ctx, append([]string{"dev", "--data-dir", d.dir, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0"}, args...), cli.Env{
			Stdin: strings.NewReader(""), Stdout: d.out, Stderr: d.errOut, Getenv: func(string) string { return "" },
		})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-d.done:
		case <-time.After(devTimeout(t, 20*time.Second)):
			t.Errorf("dev did not stop within %s", devTimeout(t, 20*time.Second))
		}
		if t.Failed() {
			t.Logf("dev stdout:\n%s\ndev stderr:\n%s", d.out, d.errOut)
		}
	})
	poll.UntilDetail(t, devTimeout(t, 60*time.Second), func() string { return "dev's banner:\n" + d.errOut.String() }, func() bool {
		select {
		case code := <-d.done:
			t.Fatalf("dev exited %d:\n%s", code, d.errOut)
		default:
		}
		return strings.Contains(d.out.String(), "Stop with Ctrl-C")
	})
	d.banner = d.out.String()
	d.env = readDevEnv(t, filepath.Join(d.dir, "dev.env"))
	return d
}

// devTimeout is how long dev, run in-process, gets to start or stop: base,
// or raceSlowdown times that in a race-detector build but not past the
// test's own deadline (less a minute, for the cleanup to report).
func devTimeout(t *testing.T, base time.Duration) time.Duration {
	d := base
	if raceEnabled {
		d *= raceSlowdown
	}
	if end, ok := t.Deadline(); ok {
		d = min(d, max(time.Until(end)-time.Minute, base))
	}
	return d
}

func readDevEnv(t *testing.T, path string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(strings.TrimPrefix(l, "export "), "="); ok && !strings.HasPrefix(k, "#") {
			out[k] = v
		}
	}
	return out
}

// cli runs the operator CLI against dev, trusting its CA.
func (d *devProc) cli(t *testing.T, args ...string) result {
	t.Helper()
	return run(t, d.env, append(args, "--ca-file", d.env["BETTER_COMPUTE_CA_FILE"])...)
}

// bcd runs bcd in-process.
func bcd(t *testing.T, stdin string, args ...string) result {
	t.Helper()
	var out, errb bytes.Buffer
	code := bcdcli.Main(context.Background(), args, bcdcli.Env{
		Stdin: strings.NewReader(stdin), Stdout: &out, Stderr: &errb,
		LookupEnv: func(string) (string, bool) { return "", false }, Unsetenv: func(string) error { return nil },
		StdinIsTerminal: func() bool { return stdin == "" },
	})
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

var bannerSHA = regexp.MustCompile(`--bcd-version (\S+) --sha256 (amd64|arm64)=([0-9a-f]{64}) --download-ca-file (\S+) > install-bcd.sh`)

// R11.5, R3.5, R7.1, R4: every flow of the README on one laptop. dev serves
// https with its own CA (ca.pem, BETTER_COMPUTE_CA_FILE in dev.env), serves
// the bcd it was given under the downloads path, and prints an install
// script command that works: the generated script downloads that bcd over
// https trusting only dev's CA, checks its SHA-256 and joins a fake machine
// through dev's gateway, with certificates of the --cert-ttl lifetime.
func TestDevInstallScript(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	d := startDev(t, "--cert-ttl", "90s", "--bcd-binary", exe)

	// dev.env and ca.pem.
	caFile := filepath.Join(d.dir, "ca.pem")
	if d.env["BETTER_COMPUTE_CA_FILE"] != caFile || !strings.HasPrefix(d.env["BETTER_COMPUTE_URL"], "https://127.0.0.1:") {
		t.Fatalf("dev.env: %v", d.env)
	}
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("ca.pem: %q", caPEM)
	}
	for _, want := range []string{"node certificates last 1m30s (--cert-ttl)", "bcd fake-machine --out ./fake-sys --serial SN-7701",
		"--sysfs-root ./fake-sys < ./join-token", "better-compute daemon install-script --pki-dir " + filepath.Join(d.dir, "pki"),
		"--base-url " + d.env["BETTER_COMPUTE_URL"] + " \\\n", "web console: " + d.env["BETTER_COMPUTE_URL"] + "/api/compute/console/", "BCD_ROOT=$PWD/host-2 BCD_SYSFS_ROOT=$PWD/fake-sys-2 sh install-bcd.sh < ./token-2"} {
		if !strings.Contains(d.banner, want) {
			t.Errorf("the banner lacks %q:\n%s", want, d.banner)
		}
	}
	m := bannerSHA.FindStringSubmatch(d.banner)
	if m == nil {
		t.Fatalf("no install-script command in the banner:\n%s", d.banner)
	}
	version, arch, sum, bannerCA := m[1], m[2], m[3], m[4]
	exeBytes, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	if h := sha256.Sum256(exeBytes); hex.EncodeToString(h[:]) != sum || bannerCA != caFile {
		t.Fatalf("the banner's sha256 %s and CA %s are not the served build's", sum, bannerCA)
	}

	// The API answers https under dev's CA, and serves the build (R11.5).
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}, Timeout: 30 * time.Second}
	res, err := hc.Get(d.env["BETTER_COMPUTE_URL"] + "/api/compute/downloads/bcd/" + version + "/linux-" + arch)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !bytes.Equal(got, exeBytes) {
		t.Fatalf("download: %s, %d bytes", res.Status, len(got))
	}
	// Without the CA the API is not trusted: it is not a public server.
	if _, err := http.Get(d.env["BETTER_COMPUTE_URL"] + "/healthz"); err == nil {
		t.Fatal("the API was trusted without dev's CA")
	}

	// A token, a fake machine, and the install script from the banner's
	// command.
	work := t.TempDir()
	token := filepath.Join(work, "token-2")
	d.cli(t, "join-tokens", "create", "--tenant", d.env["TENANT"], "--pool", d.env["POOL"], "--ttl", "1h", "--out", token).ok(t)
	sys := filepath.Join(work, "fake-sys-2")
	if r := bcd(t, "", "fake-machine", "--out", sys, "--serial", "SN-7702"); r.code != 0 {
		t.Fatalf("fake-machine: %s", r.stderr)
	}
	secret, err := os.ReadFile(filepath.Join(d.dir, "dev-secret"))
	if err != nil {
		t.Fatal(err)
	}
	gw := regexp.MustCompile(`--gateway-url (\S+)`).FindStringSubmatch(d.banner)[1]
	script := run(t, map[string]string{"BETTER_COMPUTE_SECRET": strings.TrimSpace(string(secret))}, "daemon", "install-script", "--pki-dir", filepath.Join(d.dir, "pki"),
		"--pool", d.env["POOL"], "--site", d.env["SITE"], "--gateway-url", gw, "--base-url", d.env["BETTER_COMPUTE_URL"],
		"--bcd-version", version, "--sha256", arch+"="+sum, "--download-ca-file", caFile).ok(t).stdout
	scriptPath := filepath.Join(work, "install-bcd.sh")
	if err := os.WriteFile(scriptPath, []byte(script), 0o644); err != nil {
		t.Fatal(err)
	}
	host := filepath.Join(work, "host-2")
	tok, _ := os.ReadFile(token)
	cmd := exec.Command("sh", scriptPath)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "TMPDIR=" + t.TempDir(), "HOME=" + work,
		"BCD_ROOT=" + host, "BCD_SYSFS_ROOT=" + sys, runAsBCD + "=1"}
	cmd.Stdin = bytes.NewReader(tok)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("install-bcd.sh: %v\n%s", err, out)
	}
	for _, want := range []string{"install-bcd: downloading bcd " + version + " for linux-" + arch + " from https://127.0.0.1:", "joined as node_", "install-bcd: joined pool " + d.env["POOL"] + " under BCD_ROOT (no service was started); run the daemon with: " +
		filepath.Join(host, "usr/local/bin/bcd") + " run --config " + filepath.Join(host, "etc/bcd/config.toml") + " --data-dir " + filepath.Join(host, "var/lib/bcd")} {
		if !strings.Contains(string(out), want) {
			t.Errorf("install-bcd.sh output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), strings.TrimSpace(string(tok))[5:]) {
		t.Fatal("the script printed the token")
	}

	// The node is in the pool, with a certificate of the --cert-ttl
	// lifetime (R7.1).
	r := bcd(t, "", "status", "--config", filepath.Join(host, "etc/bcd/config.toml"), "--data-dir", filepath.Join(host, "var/lib/bcd"), "--json")
	var st bcdcli.Status
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil || r.code != 0 {
		t.Fatalf("bcd status: %v %s %s", err, r.stdout, r.stderr)
	}
	if life := time.Until(st.NotAfter); life <= 0 || life > 90*time.Second {
		t.Fatalf("R7.1 the certificate is valid for %s, want at most 90 s", life)
	}
	var nl bcv1.ListNodesResponse
	d.cli(t, "nodes", "list", "--tenant", d.env["TENANT"], "--json").ok(t).decode(t, &nl)
	if len(nl.Items) != 1 || nl.Items[0].Id != st.NodeID || !nl.Items[0].HardwareKeyTrusted {
		t.Fatalf("nodes: %v, joined %s", nl.Items, st.NodeID)
	}
}

// dev --cert-ttl takes 60s to 24h in whole seconds.
func TestDevCertTTLFlag(t *testing.T) {
	for _, v := range []string{"59s", "24h1s", "90500ms", "0s", "-1m", "soon"} {
		r := run(t, nil, "dev", "--data-dir", filepath.Join(t.TempDir(), "d"), "--cert-ttl", v)
		if v == "soon" {
			if r.code != 1 || !strings.Contains(r.stderr, "invalid argument \"soon\" for \"--cert-ttl\"") {
				t.Fatalf("%s: %+v", v, r)
			}
			continue
		}
		r.fails(t, "INVALID_ARGUMENT", "--cert-ttl: want a duration from 60s to 24h in whole seconds")
	}
}
