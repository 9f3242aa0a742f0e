package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway"
)

// serve with every listener (API over TLS, metrics, the agent listener,
// the in-process gateway and its metrics) serves, and once its context
// ends stops every goroutine it started (listeners, background work, the
// gateway's, the store's; on PostgreSQL the commands listener's LISTEN
// connection too) before Run returns. R17.2: each health endpoint
// answers, the gateway's /readyz through the API in memory.
// Each HTTP/2 server of the agent listener ([agent] http2) too: its
// /readyz answers a gateway over HTTP/2 and HTTP/1.1.
func TestRunJoinsEverythingItStarted(t *testing.T) {
	for _, driver := range []string{"sqlite", "postgres"} {
		for _, h2 := range []string{AgentHTTP2NetHTTP, AgentHTTP2Framer} {
			t.Run(driver+"/"+h2, func(t *testing.T) {
				dir, secret, b, certFile, keyFile := tlsFixture(t)
				st := store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}
				if driver == "postgres" {
					st = store.Config{Driver: "postgres", DSN: storetest.PostgresDSN(t)}
				}
				cfg := Config{
					Listen: "127.0.0.1:0", RootTenant: "root", Store: st,
					TLS:     TLSConfig{CertFile: certFile, KeyFile: keyFile},
					PKI:     PKIConfig{Dir: filepath.Join(dir, "pki")},
					Metrics: MetricsConfig{Listen: "127.0.0.1:0"},
					Agent:   AgentConfig{Listen: "127.0.0.1:0", CertFile: certFile, KeyFile: keyFile, HTTP2: h2},
					Gateway: GatewayConfig{URL: "https://gw.example.com", Config: gateway.Config{
						Listen: "127.0.0.1:0", CertFile: certFile, KeyFile: keyFile, Metrics: gateway.MetricsConfig{Listen: "127.0.0.1:0"}}},
				}
				runJoinsEverything(t, cfg, secret, b)
			})
		}
	}
}

// runJoinsEverything starts Run with cfg, asks each health endpoint (the
// agent listener's as a gateway, over HTTP/2 and HTTP/1.1), stops it and
// checks that no goroutine it started is left.
func runJoinsEverything(t *testing.T, cfg Config, secret []byte, b *ca.Bundle) {
	before := goroutines.Take()
	gwMetrics, agent := make(chan string, 1), make(chan string, 1)
	r := start(t, cfg, Options{Secret: secret, Log: slog.New(slog.DiscardHandler), GatewayMetricsReady: func(a string) { gwMetrics <- a },
		AgentReady: func(a string) { agent <- a }})
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	get := func(c *http.Client, url string) {
		t.Helper()
		res, err := c.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", url, res.StatusCode, body)
		}
	}
	for _, url := range []string{"https://" + r.api + "/readyz", "http://" + r.metrics + "/readyz", "http://" + <-gwMetrics + "/readyz"} {
		get(c, url)
	}
	tr.CloseIdleConnections()
	agentURL := "https://" + <-agent + "/readyz"
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"gw.test"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	for _, h2 := range []bool{true, false} {
		atr := &http.Transport{ForceAttemptHTTP2: h2, TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{gw}}}
		if !h2 {
			atr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
		}
		get(&http.Client{Transport: atr, Timeout: 10 * time.Second}, agentURL)
		atr.CloseIdleConnections()
	}
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	goroutines.Joined(t, before)
}

// serve stops in order: the servers stop accepting before the background
// work's context ends, and serve returns (and Run closes the store) only
// once every background task returned.
func TestServeStopsBackgroundAfterServers(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Listen: "127.0.0.1:0", RootTenant: "root", Store: store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}}
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	db, err := store.Open(ctx, cfg.Store, log)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	reg, _, srv, handler, err := newMeteredAPI(ctx, cfg, Options{}, db, nil, log)
	if err != nil {
		t.Fatal(err)
	}
	l, err := listen(cfg, Options{}, log, reg, srv, handler, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The API's listener records its Close: dialing its port instead
	// would reach whatever else on the machine bound it since.
	apiLn := &closeRecorder{Listener: l.apiLn}
	l.apiLn = apiLn
	var accepting, ended atomic.Bool
	probe := func(ctx context.Context) {
		<-ctx.Done()
		if !apiLn.closed.Load() {
			accepting.Store(true)
		}
		// Still able to use the store: it has not closed.
		if err := db.ReadTx(context.Background(), func(*store.Tx) error { return nil }); err != nil {
			t.Errorf("the store after the servers stopped: %v", err)
		}
		ended.Store(true)
	}
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- serve(ctx, cfg, Options{Ready: func(string) { close(ready) }}, log, l, srv, append(background(cfg.Export, db, srv, nil, log), probe))
	}()
	<-ready
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
	if !ended.Load() {
		t.Fatal("serve returned before its background work did")
	}
	if accepting.Load() {
		t.Fatal("the background work stopped while the API still accepted connections")
	}
}

// closeRecorder is a listener that records that it was closed.
type closeRecorder struct {
	net.Listener
	closed atomic.Bool
}

func (c *closeRecorder) Close() error {
	c.closed.Store(true)
	return c.Listener.Close()
}
