// Package apitest starts a real API server in-process (httptest, real
// database) with a bootstrapped root tenant and admin key, for tests of the
// API, the client and the CLI.
package apitest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Env is a running API with a root tenant and its admin key.
type Env struct {
	DB         *store.DB
	Server     *api.Server
	HTTP       *httptest.Server
	URL        string
	RootTenant string
	AdminKey   string
	Admin      *client.Client
	Bundle     *ca.Bundle
}

// Options tune Start.
type Options struct {
	// NoJoin leaves the machine PKI out, so join calls answer INVALID_CONFIG.
	NoJoin bool
	// Attestors configures JoinService's attestors (api.Config.Attestors;
	// empty: join-token only).
	Attestors []string
	// PKIFrom, when set, generates the machine PKI as of that time (its
	// CAs valid from then, instead of from Clock's now), so that a test can
	// hold node certificates that expired in the past.
	PKIFrom time.Time
	// Clock is the API's clock (api.Config.Clock); nil is the wall clock.
	// A clock.Fake lets session tests move the session service's checks,
	// polls and timeouts instead of sleeping.
	Clock clock.Clock
	// Log is the API's log (api.Config.Log); nil discards it.
	Log *slog.Logger
	// HeartbeatMAC turns on the session heartbeat MAC
	// (api.Config.HeartbeatMAC).
	HeartbeatMAC bool
	// Metrics is the API's fleet metrics (api.Config.Metrics); nil counts
	// nothing.
	Metrics *apimetrics.API
	// Tracer is the API's tracer provider (api.Config.Tracer); nil: the
	// global one, a no-op.
	Tracer trace.TracerProvider
	// CertTTL is the node certificates' lifetime (api.Config.CertTTL); 0:
	// the default, 24 h.
	CertTTL time.Duration
}

// Start runs the API on db.
func Start(t testing.TB, db *store.DB, opts Options) *Env {
	t.Helper()
	ctx := context.Background()
	var bundle *ca.Bundle
	if !opts.NoJoin {
		var err error
		// The PKI is as of the API's clock: a fake clock made before the
		// store opened lags the wall clock by however long that took
		// (seconds under -race), and certificates it dates would start
		// before the CAs do.
		from := opts.PKIFrom
		if from.IsZero() && opts.Clock != nil {
			from = opts.Clock.Now()
		}
		if from.IsZero() {
			from = time.Now()
		}
		bundle, err = ca.Generate("test.example.com", from)
		if err != nil {
			t.Fatalf("pki: %v", err)
		}
	}
	srv, err := api.New(api.Config{DB: db, Bundle: bundle, Attestors: opts.Attestors, Clock: opts.Clock, Log: opts.Log, Metrics: opts.Metrics, Tracer: opts.Tracer, CertTTL: opts.CertTTL,
		HeartbeatMAC: opts.HeartbeatMAC,
		// In-process tests ask once their vouch is in: no discovery
		// refusal waits for one (join.DefaultVouchWait is for real boots).
		JoinVouchWait: time.Nanosecond})
	if err != nil {
		t.Fatalf("api.New: %v", err)
	}
	root, _, err := srv.Tenancy().Bootstrap(ctx, "root")
	if err != nil {
		t.Fatalf("bootstrap: %v", err)
	}
	var key string
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		_, key, err = authz.NewKey(ctx, tx, root.ID, "admin", authz.Admin, 0, now)
		return err
	})
	if err != nil {
		t.Fatalf("admin key: %v", err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(hs.Close)
	c, err := client.New(client.Config{URL: hs.URL, APIKey: key})
	if err != nil {
		t.Fatal(err)
	}
	return &Env{DB: db, Server: srv, HTTP: hs, URL: hs.URL, RootTenant: root.ID, AdminKey: key, Admin: c, Bundle: bundle}
}

// Client returns a client using key.
func (e *Env) Client(t testing.TB, key string) *client.Client {
	t.Helper()
	c, err := client.New(client.Config{URL: e.URL, APIKey: key})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Each runs fn against a fresh API on SQLite and on PostgreSQL.
func Each(t *testing.T, opts Options, fn func(t *testing.T, e *Env)) {
	t.Helper()
	storetest.Each(t, func(t *testing.T, db *store.DB) { fn(t, Start(t, db, opts)) })
}

// StartAgent serves h (an API's AgentHandler) as the agent listener: TLS
// with a serving-CA certificate for 127.0.0.1, HTTP/2, and a client
// certificate from the serving CA required, as `serve` does. It closes
// when the test ends.
func StartAgent(t testing.TB, h http.Handler, b *ca.Bundle) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.TLS = agentTLS(t, b)
	srv.TLS.NextProtos = nil // httptest sets its own
	srv.Config.ErrorLog = slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

// The agent listener's HTTP/2 servers ([agent] http2), for tests that run
// on each (StartAgentOn).
const (
	AgentNetHTTP = "net/http"
	AgentFramer  = "framer"
)

// AgentTransports are the agent listener's HTTP/2 servers.
var AgentTransports = []string{AgentNetHTTP, AgentFramer}

// StartAgentOn serves e's agent protocol as the agent listener on
// transport, as `serve` does with [agent] http2 set to it: net/http
// (StartAgent with AgentHandler), or h2server with sessions on callbacks
// (AgentStreams). It returns the listener's URL and closes when the test
// ends.
func StartAgentOn(t testing.TB, e *Env, transport string) string {
	t.Helper()
	return StartServerAgentOn(t, e.Server, e.Bundle, transport)
}

// StartServerAgentOn is StartAgentOn for srv, an API server on b's PKI
// that Start did not start (another replica, say).
func StartServerAgentOn(t testing.TB, srv *api.Server, b *ca.Bundle, transport string) string {
	t.Helper()
	if transport != AgentFramer {
		return StartAgent(t, srv.AgentHandler(), b).URL
	}
	return StartFramer(t, srv.AgentStreams(srv.AgentHandler()), b)
}

// StartFramer serves h on h2server as StartAgent serves an http.Handler:
// TLS with a serving-CA certificate for 127.0.0.1 and a client
// certificate from the serving CA required. It returns the URL; the
// server closes, and its goroutines end, when the test ends.
func StartFramer(t testing.TB, h h2server.Handler, b *ca.Bundle) string {
	t.Helper()
	srv, err := h2server.New(h2server.Config{Handler: h, TLS: agentTLS(t, b), Log: slog.New(slog.DiscardHandler), MaxConcurrentStreams: 100000})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
	return "https://" + ln.Addr().String()
}

// agentTLS is the agent listener's TLS in tests: a serving-CA
// certificate for 127.0.0.1, client certificates from the serving CA
// required.
func agentTLS(t testing.TB, b *ca.Bundle) *tls.Config {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AddCert(b.ServingCA)
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas}
}

// GatewayTransport is a transport with a gateway's client certificate from
// b's serving CA, trusting the serving CA: what a gateway dials the agent
// listener (StartAgent) with. Its idle connections close when the test
// ends.
func GatewayTransport(t testing.TB, b *ca.Bundle) *http.Transport {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"gw.test"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	gw, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	tr := &http.Transport{ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, Certificates: []tls.Certificate{gw}}}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}
