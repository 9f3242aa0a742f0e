package gateway

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var testNow = time.Now()

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// env is one machine PKI with a gateway certificate and an API agent
// listener certificate, both from the serving CA, written to files.
type env struct {
	bundle   *ca.Bundle
	dir      string
	certFile string
	keyFile  string
	caFile   string
	gwLeaf   []byte // DER of the gateway's leaf
	apiCert  tls.Certificate
	roots    *x509.CertPool // the serving CA
	// kind is the daemons' HTTP/2 server of the gateways the test starts
	// (Config.DaemonHTTP2; empty: the default, the framer), relay their
	// session relay (Config.SessionRelay; empty: the default, callbacks
	// on the framer).
	kind, relay string
}

// daemonServers are the daemons' HTTP/2 servers the relay tests run on.
var daemonServers = []string{DaemonHTTP2NetHTTP, DaemonHTTP2Framer}

// onBothServers runs f once per daemon-side HTTP/2 server, as subtests
// ("nethttp", "framer"), each with its own env.
func onBothServers(t *testing.T, f func(t *testing.T, e *env)) {
	forServers(t, func(t *testing.T, kind string) {
		e := newEnv(t)
		e.kind = kind
		f(t, e)
	})
}

// forServers runs f once per daemon-side HTTP/2 server, as subtests.
func forServers(t *testing.T, f func(t *testing.T, kind string)) {
	for _, kind := range daemonServers {
		t.Run(strings.ReplaceAll(kind, "/", ""), func(t *testing.T) { f(t, kind) })
	}
}

// sessionSide is how a gateway serves sessions: its daemons' HTTP/2
// server and its session relay.
type sessionSide struct{ kind, relay string }

// sessionSides are what the session tests run on: each HTTP/2 server with
// the goroutine relay, and the framer with the callback relay.
var sessionSides = []sessionSide{
	{DaemonHTTP2NetHTTP, SessionRelayGoroutines},
	{DaemonHTTP2Framer, SessionRelayGoroutines},
	{DaemonHTTP2Framer, SessionRelayCallbacks},
}

func (s sessionSide) name() string {
	n := strings.ReplaceAll(s.kind, "/", "")
	if s.relay == SessionRelayCallbacks {
		n += "-callbacks"
	}
	return n
}

// apply makes e's gateways serve sessions as s.
func (s sessionSide) apply(e *env) { e.kind, e.relay = s.kind, s.relay }

// forSessionSides runs f once per sessionSides entry, as subtests
// ("nethttp", "framer", "framer-callbacks").
func forSessionSides(t *testing.T, f func(t *testing.T, s sessionSide)) {
	for _, s := range sessionSides {
		t.Run(s.name(), func(t *testing.T) { f(t, s) })
	}
}

// onEverySessionSide runs f once per sessionSides entry, as subtests,
// each with its own env.
func onEverySessionSide(t *testing.T, f func(t *testing.T, e *env)) {
	forSessionSides(t, func(t *testing.T, s sessionSide) {
		e := newEnv(t)
		s.apply(e)
		f(t, e)
	})
}

func newEnv(t testing.TB) *env {
	t.Helper()
	b, err := ca.Generate("compute.example.com", testNow)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{bundle: b, dir: t.TempDir(), roots: x509.NewCertPool()}
	e.roots.AddCert(b.ServingCA)
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"127.0.0.1"}, testNow, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	e.certFile = e.write(t, "gateway.crt", certPEM)
	e.keyFile = e.write(t, "gateway.key", keyPEM)
	e.caFile = e.write(t, "serving-ca.pem", pki.CertPEM(b.ServingCA))
	gw, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	e.gwLeaf = gw.Certificate[0]
	apiPEM, apiKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, testNow, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if e.apiCert, err = tls.X509KeyPair(apiPEM, apiKey); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) write(t testing.TB, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(e.dir, name)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// nodeCert issues a node client certificate, as JoinService would.
func (e *env) nodeCert(t testing.TB, nodeID string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "n"}}, key)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := ca.SignNodeCert(e.bundle.NodeCA, e.bundle.NodeCAKey, csr, ca.NodeCertParams{
		TrustDomain: e.bundle.TrustDomain, SiteID: "site_1", NodeID: nodeID, Role: pki.RoleNode,
		NotBefore: testNow.Add(-time.Minute), NotAfter: testNow.Add(time.Hour),
	})
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{nc.DER}, PrivateKey: key}
}

// call is what the fake API saw of one relayed call.
type call struct {
	procedure string
	header    http.Header
	join      *agentv1.JoinRequest
	renew     *agentv1.RenewRequest
}

// fakeAPI is the API's agent listener: mTLS requiring a client certificate
// from the serving CA, HTTP/2, JoinService answering from canned data.
type fakeAPI struct {
	agentv1connect.UnimplementedJoinServiceHandler
	srv   *httptest.Server
	env   *env
	conns atomic.Int64 // TCP connections accepted
	// violations counts calls that were not HTTP/2 or not from the gateway's
	// identity; they are answered 403.
	violations atomic.Int64

	mu    sync.Mutex
	calls []call

	// block, when set, holds a Join with sealed token "block" until closed;
	// entered receives once it is held.
	block   chan struct{}
	entered chan struct{}
}

var (
	fakeBody = func() []byte { // every byte value, so nothing is re-encoded silently
		b := make([]byte, 512)
		for i := range b {
			b[i] = byte(i)
		}
		return b
	}()
	fakeSig = []byte{0x30, 0x45, 0x02, 0x20, 0x00, 0xff, 0x7f, 0x80, 0x0a, 0x0d}
)

func newFakeAPI(t testing.TB, e *env) *fakeAPI {
	t.Helper()
	f := &fakeAPI{env: e, block: make(chan struct{}), entered: make(chan struct{}, 1)}
	path, h := agentv1connect.NewJoinServiceHandler(f)
	mux := http.NewServeMux()
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor != 2 || r.TLS == nil || len(r.TLS.PeerCertificates) == 0 ||
			string(r.TLS.PeerCertificates[0].Raw) != string(e.gwLeaf) {
			f.violations.Add(1)
			http.Error(w, "not the gateway over h2", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	}))
	f.srv = httptest.NewUnstartedServer(mux)
	f.srv.EnableHTTP2 = true
	f.srv.TLS = &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{e.apiCert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    e.roots,
	}
	f.srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			f.conns.Add(1)
		}
	}
	f.srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeAPI) URL() string { return f.srv.URL }

func (f *fakeAPI) record(c call) {
	f.mu.Lock()
	f.calls = append(f.calls, c)
	f.mu.Unlock()
}

func (f *fakeAPI) last(t testing.TB) call {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.calls) == 0 {
		t.Fatal("the fake API saw no call")
	}
	return f.calls[len(f.calls)-1]
}

func (f *fakeAPI) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

// The canned refusals the fake answers by sealed token, mapped the way the
// API maps them.
var fakeRefusals = map[string]error{
	"refuse":   errs.New(errs.AccessDenied, "Join refused"),
	"conflict": errs.New(errs.Conflict, "This machine joined concurrently; retry"),
	"bad-csr":  errs.Invalid("csr", "not a PKCS#10 request"),
	"no-pki":   errs.New(errs.InvalidConfig, "JoinService is not configured"),
}

func (f *fakeAPI) Join(ctx context.Context, req *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
	f.record(call{procedure: agentv1connect.JoinServiceJoinProcedure, header: req.Header().Clone(), join: proto.Clone(req.Msg).(*agentv1.JoinRequest)})
	if err, ok := fakeRefusals[req.Msg.SealedToken]; ok {
		return nil, wire.ToWire(quietLog(), agentv1connect.JoinServiceJoinProcedure, err)
	}
	if req.Msg.SealedToken == "block" {
		f.entered <- struct{}{}
		select {
		case <-f.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return connect.NewResponse(&agentv1.JoinResponse{Body: fakeBody, Sig: fakeSig}), nil
}

func (f *fakeAPI) Renew(_ context.Context, req *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
	f.record(call{procedure: agentv1connect.JoinServiceRenewProcedure, header: req.Header().Clone(), renew: proto.Clone(req.Msg).(*agentv1.RenewRequest)})
	if req.Msg.NodeId == "refuse" {
		return nil, wire.ToWire(quietLog(), agentv1connect.JoinServiceRenewProcedure, errs.New(errs.AccessDenied, "Renew refused"))
	}
	return connect.NewResponse(&agentv1.RenewResponse{Body: fakeBody, Sig: fakeSig}), nil
}

func (e *env) config(apiURL string) Config {
	return Config{Listen: "127.0.0.1:0", CertFile: e.certFile, KeyFile: e.keyFile, APIURL: apiURL, APICAFile: e.caFile, DaemonHTTP2: e.kind, SessionRelay: e.relay}
}

// droppingListener listens on 127.0.0.1 and closes every connection it
// accepts, as a process that is down would refuse it, and returns its
// address. It stays open until the test ends, so the port cannot go to
// another process meanwhile (closing it and dialing the port would).
func droppingListener(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return ln.Addr().String()
}

// startGateway serves a gateway on 127.0.0.1 and returns its address.
func startGateway(t testing.TB, cfg Config) (*Gateway, string) {
	t.Helper()
	return startGatewayWith(t, cfg, Options{Log: quietLog()})
}

// startGatewayWith is startGateway with o (its log and clock).
func startGatewayWith(t testing.TB, cfg Config, o Options) (*Gateway, string) {
	t.Helper()
	g, err := New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	// What the config asked for, its defaults applied.
	if framer := g.h2 != nil; framer != (g.cfg.DaemonHTTP2 == DaemonHTTP2Framer) {
		t.Fatalf("daemon_http2 %q, but serving with h2server: %v", g.cfg.DaemonHTTP2, framer)
	}
	if callbacks := len(g.ups) > 0 && g.ups[0].h2 != nil; callbacks != (g.cfg.SessionRelay == SessionRelayCallbacks) {
		t.Fatalf("session_relay %q, but relaying on h2upstream: %v", g.cfg.SessionRelay, callbacks)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := g.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return g, ln.Addr().String()
}

// daemon is a bcd-like client: gRPC over TLS trusting the serving CA, with
// an optional client certificate.
type daemon struct {
	client    agentv1connect.JoinServiceClient
	tr        *http.Transport
	localAddr atomic.Value // string: the last connection's local address
}

func newDaemon(t testing.TB, e *env, gwAddr string, certs ...tls.Certificate) *daemon {
	t.Helper()
	d := &daemon{}
	dialer := &net.Dialer{Timeout: 5 * time.Second}
	d.tr = &http.Transport{
		ForceAttemptHTTP2: true,
		TLSClientConfig:   &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: certs},
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := dialer.DialContext(ctx, network, addr)
			if err == nil {
				d.localAddr.Store(c.LocalAddr().String())
			}
			return c, err
		},
		MaxIdleConnsPerHost: 64,
	}
	t.Cleanup(d.tr.CloseIdleConnections)
	d.client = agentv1connect.NewJoinServiceClient(&http.Client{Transport: d.tr}, "https://"+gwAddr, connect.WithGRPC())
	return d
}

func (d *daemon) addr() string { s, _ := d.localAddr.Load().(string); return s }

func productError(t testing.TB, err error) *errs.E {
	t.Helper()
	if err == nil {
		t.Fatal("expected an error, got none")
	}
	e, ok := errs.As(wire.FromWire(err))
	if !ok {
		t.Fatalf("FromWire(%v) carries no product code", err)
	}
	return e
}

// issue writes a certificate from the serving CA with the given usages and
// its PKCS#8 key, and returns the two paths.
func (e *env) issue(t testing.TB, usages []x509.ExtKeyUsage) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    testNow.Add(-time.Minute),
		NotAfter:     testNow.Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usages,
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, e.bundle.ServingCA, key.Public(), e.bundle.ServingCAKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile = e.write(t, "issued.crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	keyFile = e.write(t, "issued.key", pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	return certFile, keyFile
}
