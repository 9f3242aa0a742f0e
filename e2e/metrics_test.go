package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// listening returns the addr of the JSON log line msg in out, "" until
// there is one.
func listening(out, msg string) string {
	for _, line := range strings.Split(out, "\n") {
		var l map[string]any
		if json.Unmarshal([]byte(line), &l) == nil && l["msg"] == msg {
			a, _ := l["addr"].(string)
			return a
		}
	}
	return ""
}

// listened waits for p's JSON log line msg and returns its addr.
func listened(t *testing.T, p *proc, msg string) string {
	t.Helper()
	var addr string
	waitFor(t, msg, 30*time.Second, func() bool {
		addr = listening(p.output(), msg)
		return addr != ""
	})
	return addr
}

// R17.1, R17.2, R17.3: real processes (dev: the API and its gateway; bcd)
// with JSON logs at debug level. A burst of joins, a refusal, a renewal and
// a session move the API's, the gateway's and bcd's series by exactly what
// happened; bcd's /readyz turns ready; and no log line carries a token's
// secret, a private key or the API key.
func TestMetricsMoveR17_1(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	dev := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0",
		"--metrics-listen", "127.0.0.1:0", "--gateway-metrics-listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug")
	var apiMetrics, gwMetrics string
	waitFor(t, "dev to serve", 60*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(data, "bcd", "config.toml"))
		apiMetrics, gwMetrics = listening(dev.output(), "metrics listening"), listening(dev.output(), "gateway metrics listening")
		return err == nil && apiMetrics != "" && gwMetrics != ""
	})
	env := readEnv(t, filepath.Join(data, "dev.env"))
	e := envList(env)
	api0 := telemetrytest.Scrape(t, nil, "http://"+apiMetrics+"/metrics")
	gw0 := telemetrytest.Scrape(t, nil, "http://"+gwMetrics+"/metrics")

	// bcd's config, with its diagnostics listener (on the port the kernel
	// picks, read from bcd run's log) and JSON logs.
	conf := filepath.Join(data, "bcd", "config.toml")
	f, err := os.OpenFile(conf, os.O_APPEND|os.O_WRONLY, 0)
	must(t, err)
	_, err = fmt.Fprintf(f, "\n[diagnostics]\nlisten = %q\n\n[log]\nformat = \"json\"\nlevel = \"debug\"\n", "127.0.0.1:0")
	must(t, err)
	must(t, f.Close())

	token := func(uses int) string {
		file := filepath.Join(dir, fmt.Sprintf("token-%d-%d", uses, time.Now().UnixNano()))
		if out, errOut, code := run(t, e, "", bc, "join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "1h",
			"--max-uses", fmt.Sprint(uses), "--out", file); code != 0 {
			t.Fatalf("create token: %s %s", out, errOut)
		}
		b, err := os.ReadFile(file)
		must(t, err)
		return strings.TrimSpace(string(b))
	}
	machine := func(i int) (sys, dataDir string) {
		sys, dataDir = filepath.Join(dir, fmt.Sprintf("sys%d", i)), filepath.Join(dir, fmt.Sprintf("data%d", i))
		fakeSysfs(t, sys, fmt.Sprintf("SN-%04d", i), fmt.Sprintf("4c4c4544-0042-3510-8053-%012d", i), fmt.Sprintf("3c:ec:ef:01:02:%02x", i))
		return sys, dataDir
	}
	join := func(tok string, i int) (string, int) {
		sys, dd := machine(i)
		out, errOut, code := run(t, nil, tok+"\n", bcd, "join", "--config", conf, "--sysfs-root", sys, "--data-dir", dd)
		return out + errOut, code
	}

	// The burst: five machines on one token.
	const burst = 5
	tok := token(burst)
	var tokens = []string{tok}
	for i := range burst {
		if out, code := join(tok, i); code != 0 {
			t.Fatalf("join %d: %s", i, out)
		}
	}
	// A refusal: a used-up token.
	one := token(1)
	tokens = append(tokens, one)
	if out, code := join(one, 10); code != 0 {
		t.Fatalf("join 10: %s", out)
	}
	if out, code := join(one, 11); code == 0 || !strings.Contains(out, "refused") {
		t.Fatalf("join with a used-up token: %d %s", code, out)
	}
	// A renewal.
	if out, errOut, code := run(t, nil, "", bcd, "renew", "--config", conf, "--data-dir", filepath.Join(dir, "data0")); code != 0 {
		t.Fatalf("bcd renew: %s %s", out, errOut)
	}
	// A session, and bcd's readiness.
	daemon := start(t, nil, bcd, "run", "--config", conf, "--data-dir", filepath.Join(dir, "data0"))
	diagAddr := listened(t, daemon, "diagnostics listening")
	waitFor(t, "bcd ready", 30*time.Second, func() bool {
		code, _ := httpGet("http://" + diagAddr + "/readyz")
		return code == 200
	})
	if code, body := httpGet("http://" + diagAddr + "/livez"); code != 200 {
		t.Errorf("bcd /livez %d %s", code, body)
	}
	if code, body := httpGet("http://" + gwMetrics + "/readyz"); code != 200 {
		t.Errorf("gateway /readyz %d %s", code, body)
	}

	api := telemetrytest.Scrape(t, nil, "http://"+apiMetrics+"/metrics")
	gw := telemetrytest.Scrape(t, nil, "http://"+gwMetrics+"/metrics")
	node := telemetrytest.Scrape(t, nil, "http://"+diagAddr+"/metrics")
	moved := func(who string, before, after telemetrytest.Values, want float64, name string, labels ...string) {
		t.Helper()
		if got := after.Get(name, labels...) - before.Get(name, labels...); got != want {
			t.Errorf("%s %s%v moved by %v, want %v", who, name, labels, got, want)
		}
	}
	moved("api", api0, api, burst+1, telemetry.Joins, "attestor", "join-token", "outcome", "admitted")
	moved("api", api0, api, 1, telemetry.Joins, "outcome", "refused", "reason", "token-used-up")
	moved("api", api0, api, burst+1, telemetry.TokenSpends)
	moved("api", api0, api, 1, telemetry.Renewals, "outcome", "admitted")
	moved("api", api0, api, burst+2, telemetry.CertificatesIssued)
	moved("api", api0, api, 1, telemetry.SessionsOpened)
	moved("api", api0, api, 1, telemetry.SessionsHeld)
	moved("gateway", gw0, gw, 1, telemetry.GatewaySessionsOpened)
	moved("gateway", gw0, gw, 1, telemetry.GatewaySessionsHeld)
	moved("gateway", gw0, gw, 0, telemetry.GatewayRelayErrors)
	moved("bcd", nil, node, 0, telemetry.NodeSessionReconnects)
	if exp := node.Get(telemetry.NodeCertExpiry); exp < 3600 {
		t.Errorf("bcd certificate expiry %v s, want the day-long certificate's", exp)
	}
	if exp := api.Get(telemetry.KeyExpirySeconds, "key", "node-ca"); exp < 86400 {
		t.Errorf("node CA expiry %v s", exp)
	}

	// R17.3: no secret in any log line; the refusal's line has the
	// common keys.
	checkLogs(t, dev.output(), daemon.output(), env, tokens)
}

func httpGet(url string) (int, string) {
	res, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

// checkLogs looks for the API key, private keys and every token (whole,
// and its secret) in the logs, and for the refusal's JSON line with its
// reason and tenant.
func checkLogs(t *testing.T, devOut, bcdOut string, env map[string]string, tokens []string) {
	t.Helper()
	logs := devOut + bcdOut
	_, apiKeySecret, _ := strings.Cut(env["BETTER_COMPUTE_API_KEY"], ".")
	secrets := map[string]string{"API key": env["BETTER_COMPUTE_API_KEY"], "API key secret": apiKeySecret, "private key": "PRIVATE KEY"}
	for i, tk := range tokens {
		_, s, _ := strings.Cut(tk, ".")
		secrets[fmt.Sprintf("token %d", i)], secrets[fmt.Sprintf("token %d secret", i)] = tk, s
	}
	for what, s := range secrets {
		if len(s) < 8 {
			t.Fatalf("%s %q: too short to look for", what, s)
		}
		if strings.Contains(logs, s) {
			t.Errorf("the logs carry the %s", what)
		}
	}
	// The refusal is one JSON line with the common keys.
	var refused map[string]any
	for _, line := range strings.Split(devOut, "\n") {
		var l map[string]any
		if json.Unmarshal([]byte(line), &l) == nil && l["msg"] == "join refused" {
			refused = l
		}
	}
	if refused[telemetry.LogReason] != "join-token:token-used-up" || refused[telemetry.LogTenant] != env["TENANT"] {
		t.Errorf("the refusal's log line %v, want reason join-token:token-used-up and tenant %s", refused, env["TENANT"])
	}
}
