package run_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/apitest"
	"github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	"github.com/better-compute/better-compute/internal/bcd/run"
	"github.com/better-compute/better-compute/internal/controller"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/join"
	"github.com/better-compute/better-compute/internal/join/jointest"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
)

// Harness for the session tests: the real API (apitest) with its agent
// listener over mTLS, a real gateway in front of it, the controller, and
// bcd's run loop in-process against a fake procfs. Nodes join through the
// real JoinService in-process and their identity is saved as bcd saves it.

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func rq[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

type harness struct {
	e      *apitest.Env
	gwAddr string
	site   *bcv1.Site
	dir    string
	n      int // machines made so far
}

func newHarness(t *testing.T, e *apitest.Env) *harness {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	h := &harness{e: e, dir: t.TempDir()}
	b := e.Bundle
	now := time.Now()

	// The API's agent listener: mTLS requiring a serving-CA client cert.
	apiPEM, apiKey, err := pki.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	apiCert, err := tls.X509KeyPair(apiPEM, apiKey)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	agent := httptest.NewUnstartedServer(e.Server.AgentHandler())
	agent.EnableHTTP2 = true
	agent.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{apiCert},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: roots}
	agent.Config.ErrorLog = slog.NewLogLogger(quiet().Handler(), slog.LevelError)
	agent.StartTLS()
	t.Cleanup(agent.Close)

	// The gateway.
	gwPEM, gwKey, err := pki.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile, caFile := h.write(t, "gw.crt", gwPEM), h.write(t, "gw.key", gwKey), h.write(t, "ca.pem", pki.CertPEM(b.ServingCA))
	g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: certFile, KeyFile: keyFile, APIURL: agent.URL, APICAFile: caFile},
		gateway.Options{Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(func() {
		sctx, c := context.WithTimeout(context.Background(), 2*time.Second)
		defer c()
		_ = g.Shutdown(sctx)
	})
	h.gwAddr = ln.Addr().String()

	// The controller, woken like the server wakes it.
	sess := e.Server.Sessions()
	ctrl := controller.New(controller.Config{DB: e.DB, Hub: e.Server.Hub(), Log: quiet(), Poll: 100 * time.Millisecond, Notify: sess.Notify})
	sess.OnResult(ctrl.Wake)
	go ctrl.Run(ctx)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-e.Server.Hub().Wait():
				ctrl.Wake()
			}
		}
	}()

	s, err := e.Admin.Sites.CreateSite(ctx, rq(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	h.site = s.Msg
	return h
}

func (h *harness) write(t testing.TB, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(h.dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func (h *harness) pool(t *testing.T, name string, acc *bcv1.AcceptancePolicy) *bcv1.Pool {
	t.Helper()
	var pol *bcv1.PoolPolicy
	if acc != nil {
		pol = &bcv1.PoolPolicy{Acceptance: acc}
	}
	p, err := h.e.Admin.Pools.CreatePool(context.Background(), rq(&bcv1.CreatePoolRequest{TenantId: h.e.RootTenant, SiteId: h.site.Id, Name: name, Agent: "bcd", Policy: pol}))
	if err != nil {
		t.Fatal(err)
	}
	return p.Msg
}

func (h *harness) token(t *testing.T, pool *bcv1.Pool, reclaim bool) string {
	t.Helper()
	tok, err := h.e.Admin.JoinTokens.CreateJoinToken(context.Background(), rq(&bcv1.CreateJoinTokenRequest{
		TenantId: h.e.RootTenant, PoolId: pool.Id, TtlSeconds: 3600, MaxUses: 5, AllowReclaim: reclaim}))
	if err != nil {
		t.Fatal(err)
	}
	return tok.Msg.Token
}

// machine is one joined node as bcd keeps it: a data directory with its
// identity, a fake procfs, a config.
type machine struct {
	nodeID string
	store  *identity.Store
	cfg    *config.Config
	id     *identity.Identity
}

// join joins machine i (its claims) with token and saves the identity in a
// fresh data directory; cpus is what its fake procfs reports.
func (h *harness) join(t *testing.T, token string, i, cpus int) *machine {
	t.Helper()
	h.n++
	signer, record, err := identity.SoftwareKeys{}.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(signer, "")
	if err != nil {
		t.Fatal(err)
	}
	req := &agentv1.JoinRequest{Csr: csr, Claims: jointest.Claims(i), Protocol: 1}
	req.SealedToken = jointest.Seal(t, h.e.Bundle, token, req)
	res, err := h.e.Server.Join().Join(context.Background(), req, join.Peer{Addr: "192.0.2.1:1"})
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.Body, &body); err != nil {
		t.Fatal(err)
	}
	chainPEM, bundlePEM := pemOf(body.CertChain), pemOf(body.CommandBundle)
	id, err := identity.NewIdentity(chainPEM, "", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(h.dir, "m"+strings.Repeat("x", h.n))
	st := &identity.Store{Dir: filepath.Join(base, "data")}
	if err := st.Save(id, record, chainPEM, bundlePEM); err != nil {
		t.Fatal(err)
	}
	loaded, err := st.Load()
	if err != nil {
		t.Fatal(err)
	}
	procfs := filepath.Join(base, "proc")
	var cpu strings.Builder
	for c := range cpus {
		cpu.WriteString("processor\t: " + strconv.Itoa(c) + "\nmodel name\t: test\n\n")
	}
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "cpuinfo"), []byte(cpu.String()))
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "meminfo"), []byte("MemTotal:       16318480 kB\nMemFree:         1000000 kB\n"))
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "driver/nvidia/gpus/0000:3b:00.0/information"), []byte("GPU UUID: GPU-1\n"))
	pins, err := h.e.Bundle.Pins()
	if err != nil {
		t.Fatal(err)
	}
	cfg := &config.Config{GatewayURL: "https://" + h.gwAddr, Site: h.site.Id, ServingCASPKIPin: pins.ServingCA,
		JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption, DataDir: st.Dir, ProcfsRoot: procfs}
	cfg.ApplyDefaults()
	return &machine{nodeID: id.NodeID, store: st, cfg: cfg, id: loaded}
}

func pemOf(ders [][]byte) []byte {
	var out []byte
	for _, d := range ders {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: d})...)
	}
	return out
}

// start runs bcd's loop for m until the returned stop is called; welcomes
// receives the node id of every Welcome.
func (h *harness) start(t *testing.T, m *machine) (welcomes chan string, stop func()) {
	t.Helper()
	welcomes = make(chan string, 16)
	d, err := run.New(run.Config{BCD: m.cfg, Store: m.store, Log: quiet(), IdentityCheck: time.Second,
		OnWelcome: func(id string) { welcomes <- id }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var stopped bool
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("bcd run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("bcd run did not stop")
		}
	}
	t.Cleanup(stop)
	return welcomes, stop
}

func (h *harness) node(t testing.TB, id string) store.Node {
	t.Helper()
	var n store.Node
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		n, err = tx.GetNode(context.Background(), id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

// waitNode waits until cond holds for the node, up to 15 s.
func (h *harness) waitNode(t testing.TB, id, what string, cond func(store.Node) bool) store.Node {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		n := h.node(t, id)
		if cond(n) {
			return n
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s: timed out waiting for %s; state %s (%q), connection %s", id, what, n.State, n.StateReason, n.Connection)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// events lists the root tenant's events of the given type prefix.
func (h *harness) events(t testing.TB, prefix string) []store.Event {
	t.Helper()
	if err := h.e.DB.WaitEventsVisible(context.Background(), h.e.RootTenant, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	var evs []store.Event
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		evs, err = tx.ListEvents(context.Background(), h.e.RootTenant, 0, 0, prefix, 1000)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return evs
}

// dial opens a session through the gateway presenting cert (none when
// nil), sends Hello, and returns the first answer or error.
func (h *harness) dial(t testing.TB, cert *tls.Certificate) (*agentv1.SessionServerMessage, error) {
	t.Helper()
	roots := x509.NewCertPool()
	roots.AddCert(h.e.Bundle.ServingCA)
	tc := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, NextProtos: []string{"h2"}}
	if cert != nil {
		tc.Certificates = []tls.Certificate{*cert}
	}
	tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	c := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+h.gwAddr, connect.WithGRPC())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := c.Connect(ctx)
	defer s.CloseResponse()
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1}}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return s.Receive()
}

func (m *machine) tlsCert() *tls.Certificate {
	chain := make([][]byte, len(m.id.Chain))
	for i, c := range m.id.Chain {
		chain[i] = c.Raw
	}
	return &tls.Certificate{Certificate: chain, PrivateKey: m.id.Signer, Leaf: m.id.Leaf()}
}
