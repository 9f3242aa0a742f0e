package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	secretpkg "github.com/better-compute/better-compute/internal/shared/secret"
)

// running is a Run in a goroutine with the addresses its listeners took.
type running struct {
	api, metrics string
	cancel       context.CancelFunc
	done         chan error
}

// start runs the server and waits until it serves. Every listener is on
// port 0 and reports the port it took (no port is picked by listening,
// closing and listening again: another process could take it meanwhile).
func start(t *testing.T, cfg Config, o Options) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r := &running{cancel: cancel, done: make(chan error, 1)}
	ready, metrics := make(chan string, 1), make(chan string, 1)
	o.Ready = func(a string) { ready <- a }
	o.MetricsReady = func(a string) { metrics <- a }
	go func() { r.done <- Run(ctx, cfg, o) }()
	select {
	case r.api = <-ready:
	case err := <-r.done:
		t.Fatalf("Run: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("not ready")
	}
	if cfg.Metrics.Listen != "" {
		// The metrics listener starts before Ready.
		r.metrics = <-metrics
	}
	return r
}

// tlsFixture makes a machine PKI under dir/pki (encrypted with secret) and
// a serving certificate for 127.0.0.1 from its serving CA in certFile and
// keyFile.
func tlsFixture(t *testing.T) (dir string, secret []byte, b *ca.Bundle, certFile, keyFile string) {
	t.Helper()
	dir = t.TempDir()
	secret = []byte(secretpkg.GenerateStrong())
	b, err := ca.Init(filepath.Join(dir, "pki"), "compute.example.com", secret, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	for p, data := range map[string][]byte{certFile: certPEM, keyFile: keyPEM} {
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir, secret, b, certFile, keyFile
}

// The API serves over TLS with health, readiness, the well-known document
// and Prometheus metrics on their own listener, and shuts down gracefully
// when its context ends (R11.6).
func TestRunTLSMetricsShutdown(t *testing.T) {
	dir, secret, b, certFile, keyFile := tlsFixture(t)
	cfg := Config{
		Listen: "127.0.0.1:0", RootTenant: "root",
		TLS:     TLSConfig{CertFile: certFile, KeyFile: keyFile},
		Store:   store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:     PKIConfig{Dir: filepath.Join(dir, "pki")},
		Metrics: MetricsConfig{Listen: "127.0.0.1:0"},
		Gateway: GatewayConfig{URL: "https://gw.example.com"},
	}
	r := start(t, cfg, Options{Secret: secret})
	addr, metrics := r.api, r.metrics
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}, Timeout: 10 * time.Second}
	get := func(c *http.Client, url string) (int, string) {
		t.Helper()
		res, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		body, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(body)
	}
	for _, path := range []string{"/healthz", "/readyz"} {
		if code, body := get(c, "https://"+addr+path); code != 200 || body != "ok\n" {
			t.Fatalf("%s: %d %q", path, code, body)
		}
	}
	// R11.6: the join and gateway sections appear once the PKI and the
	// gateway are configured.
	code, body := get(c, "https://"+addr+"/api/compute/.well-known/better-compute")
	for _, want := range []string{`"name": "better-compute"`, `"encryptionJwk"`, `"signingKeyPin"`, `"servingCaPin"`, `"url": "https://gw.example.com"`} {
		if code != 200 || !strings.Contains(body, want) {
			t.Fatalf("well-known lacks %s: %d %s", want, code, body)
		}
	}
	if code, body := get(http.DefaultClient, "http://"+metrics+"/metrics"); code != 200 || !strings.Contains(body, "bc_api_requests_total") {
		t.Fatalf("metrics: %d", code)
	}
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("shutdown: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("no graceful shutdown")
	}
}

// Without BETTER_COMPUTE_SECRET a configured PKI cannot load: INVALID_CONFIG
// before anything listens.
func TestRunNeedsSecret(t *testing.T) {
	dir := t.TempDir()
	if _, err := ca.Init(filepath.Join(dir, "pki"), "compute.example.com", []byte(secretpkg.GenerateStrong()), time.Now()); err != nil {
		t.Fatal(err)
	}
	err := Run(context.Background(), Config{Listen: "127.0.0.1:0", RootTenant: "root", Store: store.Config{Path: filepath.Join(dir, "bc.db")}, PKI: PKIConfig{Dir: filepath.Join(dir, "pki")}}, Options{})
	if err == nil || !strings.Contains(err.Error(), "BETTER_COMPUTE_SECRET") {
		t.Fatalf("err = %v", err)
	}
}

var requestsSeries = regexp.MustCompile(`(?m)^bc_api_requests_total\{code="([a-z_0-9]+)",path="([^"]*)"\} (\d+)$`)

// metric labels come from a bounded set. Unauthenticated
// requests to thousands of distinct paths (and unknown procedures of a
// real service) all count under "other"; a real procedure and a real route
// keep their own label.
func TestMetricsLabelsBounded(t *testing.T) {
	dir := t.TempDir()
	r := start(t, Config{
		Listen: "127.0.0.1:0", RootTenant: "root",
		Store:   store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		Metrics: MetricsConfig{Listen: "127.0.0.1:0"},
	}, Options{})
	c := &http.Client{Timeout: 10 * time.Second}
	do := func(method, path, body string) int {
		t.Helper()
		req, err := http.NewRequest(method, "http://"+r.api+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		res, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, res.Body)
		res.Body.Close()
		return res.StatusCode
	}
	const distinct = 1500
	for i := range distinct {
		switch i % 3 {
		case 0:
			do("GET", fmt.Sprintf("/probe-%d", i), "")
		case 1:
			do("POST", fmt.Sprintf("/api/compute/bettercompute.v1.NodeService/Nope%d", i), "{}")
		case 2:
			do("GET", "/"+strings.Repeat("x", 50+i%40)+fmt.Sprint(i), "")
		}
	}
	if code := do("POST", "/api/compute/bettercompute.v1.TenantService/ListTenants", "{}"); code != http.StatusUnauthorized {
		t.Fatalf("unauthenticated ListTenants: %d", code)
	}
	if code := do("GET", "/healthz", ""); code != 200 {
		t.Fatalf("healthz: %d", code)
	}

	// R17.2: the metrics listener answers health too.
	for _, p := range []string{"/livez", "/readyz"} {
		res, err := c.Get("http://" + r.metrics + p)
		if err != nil || res.StatusCode != 200 {
			t.Fatalf("metrics listener %s: %v %v", p, res, err)
		}
		res.Body.Close()
	}
	res, err := c.Get("http://" + r.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	got := map[string]string{} // path -> count
	for _, m := range requestsSeries.FindAllStringSubmatch(string(body), -1) {
		got[m[2]+" "+m[1]] = m[3]
	}
	want := map[string]string{
		"other 404": fmt.Sprint(distinct),
		"/bettercompute.v1.TenantService/ListTenants unauthenticated": "1",
		"GET /healthz 200": "1",
	}
	if len(got) != len(want) {
		t.Fatalf("request series = %d %v, want %v", len(got), truncate(got), want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("series %q = %q, want %q (all: %v)", k, got[k], v, truncate(got))
		}
	}
}

func truncate(m map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		if len(out) == 10 {
			break
		}
		out[k] = v
	}
	return out
}

// A listener that cannot start stops Run, and every listener Run had
// started by then is closed: the metrics listener no longer answers once
// the agent listener's address was taken.
func TestRunClosesStartedListenersOnFailure(t *testing.T) {
	dir, secret, _, certFile, keyFile := tlsFixture(t)
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	cfg := Config{
		Listen: "127.0.0.1:0", RootTenant: "root",
		TLS:     TLSConfig{CertFile: certFile, KeyFile: keyFile},
		Store:   store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:     PKIConfig{Dir: filepath.Join(dir, "pki")},
		Metrics: MetricsConfig{Listen: "127.0.0.1:0"},
		Agent:   AgentConfig{Listen: taken.Addr().String(), CertFile: certFile, KeyFile: keyFile},
	}
	metrics := make(chan string, 1)
	err = Run(context.Background(), cfg, Options{Secret: secret, MetricsReady: func(a string) { metrics <- a }})
	if err == nil {
		t.Fatal("Run served with the agent listener's address taken")
	}
	addr := <-metrics
	// Binding the port again shows it was closed (a dial could connect
	// the socket to itself on loopback once the port is free).
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("the metrics listener %s is still open after Run failed: %v", addr, err)
	}
	ln.Close()
}

// The API's TLS files are read before anything listens: a config naming
// files that are not there is INVALID_CONFIG naming them, and Ready is
// never called (the first install must not say it listens and then exit).
func TestRunChecksTLSFilesFirst(t *testing.T) {
	dir := t.TempDir()
	crt, key := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	ready := false
	err := Run(context.Background(), Config{Listen: "127.0.0.1:0", RootTenant: "root", Store: store.Config{Path: filepath.Join(dir, "bc.db")},
		TLS: TLSConfig{CertFile: crt, KeyFile: key}}, Options{Ready: func(string) { ready = true }})
	if e, ok := errs.As(err); !ok || e.Code != errs.InvalidConfig || !strings.Contains(e.Message, crt) {
		t.Fatalf("err = %v, want INVALID_CONFIG naming %s", err, crt)
	}
	if ready {
		t.Fatal("the API said it was listening")
	}
}
