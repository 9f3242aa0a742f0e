package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// The API serves over TLS with health, readiness, the well-known document
// and Prometheus metrics on their own listener, and shuts down gracefully
// when its context ends (issue 2, item 4; R11.6).
func TestRunTLSMetricsShutdown(t *testing.T) {
	dir := t.TempDir()
	secret := []byte("test-secret")
	b, err := pki.Init(filepath.Join(dir, "pki"), "compute.example.com", secret, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := pki.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	metrics := freeAddr(t)
	cfg := Config{
		Listen: "127.0.0.1:0", RootTenant: "root",
		TLS:     TLSConfig{CertFile: certFile, KeyFile: keyFile},
		Store:   store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:     PKIConfig{Dir: filepath.Join(dir, "pki")},
		Metrics: MetricsConfig{Listen: metrics},
		Gateway: GatewayConfig{URL: "https://gw.example.com"},
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan string, 1)
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, Options{Secret: secret, Ready: func(a string) { ready <- a }}) }()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("Run: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("not ready")
	}
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
	cancel()
	select {
	case err := <-done:
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
	if _, err := pki.Init(filepath.Join(dir, "pki"), "compute.example.com", []byte("s"), time.Now()); err != nil {
		t.Fatal(err)
	}
	err := Run(context.Background(), Config{Listen: "127.0.0.1:0", RootTenant: "root", Store: store.Config{Path: filepath.Join(dir, "bc.db")}, PKI: PKIConfig{Dir: filepath.Join(dir, "pki")}}, Options{})
	if err == nil || !strings.Contains(err.Error(), "BETTER_COMPUTE_SECRET") {
		t.Fatalf("err = %v", err)
	}
}
