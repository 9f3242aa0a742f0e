package gateway

import (
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/checks/poll"
)

// replicaMux is an API replica's agent handler as far as the gateway
// uses it: JoinService, SessionService and /readyz.
func replicaMux(e *env) (http.Handler, *fakeSessions) {
	j := &fakeAPI{env: e, block: make(chan struct{}), entered: make(chan struct{}, 1)}
	s := &fakeSessions{}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewJoinServiceHandler(j))
	mux.Handle(agentv1connect.NewSessionServiceHandler(s))
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	return mux, s
}

// startReplica serves replicaMux as an agent listener (mTLS, HTTP/2).
func startReplica(t *testing.T, e *env) (string, *fakeSessions) {
	t.Helper()
	h, s := replicaMux(e)
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = agentListenerHTTP2()
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.URL, s
}

// exercise makes the gateway at addr relay a join and open a session,
// which it leaves open (the gateway's stop must end it), and asks the
// [metrics] listener at metrics for /readyz. It returns what the test
// closes once the gateway stopped.
func exercise(t *testing.T, e *env, addr, metrics string) (closeAll func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d := newDaemon(t, e, addr)
	if _, err := d.client.Join(ctx, connect.NewRequest(joinRequest("t"))); err != nil {
		t.Fatalf("join: %v", err)
	}
	s, tr, err := openSession(context.Background(), e, addr, nil, e.nodeCert(t, "node_01"))
	if err != nil {
		t.Fatalf("session: %v", err)
	}
	if code, body := get(t, "http://"+metrics+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz = %d %q", code, body)
	}
	return func() {
		_ = s.CloseResponse()
		tr.CloseIdleConnections()
		d.tr.CloseIdleConnections()
	}
}

// R19.2, R17.2: `better-compute gateway` (Run) relays a join and a session
// over two API replicas it health-checks, serves its [metrics] listener,
// and, once its context ends, ends the session and stops every goroutine
// it started (health checker and checks, relayed attempts, the session's
// halves, the metrics listener's loop) before Run returns.
func TestRunJoinsEverythingItStarted(t *testing.T) {
	onEverySessionSide(t, testRunJoinsEverythingItStarted)
}

func testRunJoinsEverythingItStarted(t *testing.T, e *env) {
	u1, _ := startReplica(t, e)
	u2, _ := startReplica(t, e)
	cfg := e.config("")
	cfg.APIURLs = []string{u1, u2}
	cfg.Metrics.Listen = "127.0.0.1:0"
	before := goroutines.Take()
	ready, metrics := make(chan string, 1), make(chan string, 1)
	g, err := New(cfg, Options{Log: quietLog(), Ready: func(a string) { ready <- a }, MetricsReady: func(a string) { metrics <- a }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("Run: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not listen")
	}
	closeAll := exercise(t, e, addr, <-metrics)
	defer closeAll()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	goroutines.Joined(t, before, "internal/gateway/")
}

// The gateway in the API's process (serve's [gateway] listen) runs the
// API's handler in memory for each call and session: Shutdown ends the
// session and returns once those handlers, too, have returned.
func TestInProcessShutdownJoinsEverythingItStarted(t *testing.T) {
	onBothServers(t, testInProcessShutdownJoinsEverythingItStarted)
}

func testInProcessShutdownJoinsEverythingItStarted(t *testing.T, e *env) {
	h, _ := replicaMux(e)
	cfg := e.localConfig()
	cfg.Metrics.Listen = "127.0.0.1:0"
	before := goroutines.Take()
	metrics := make(chan string, 1)
	g, err := New(cfg, Options{Log: quietLog(), LocalAPI: h, MetricsReady: func(a string) { metrics <- a }})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Serve(ln) }()
	closeAll := exercise(t, e, ln.Addr().String(), <-metrics)
	defer closeAll()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := g.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	goroutines.Joined(t, before, "internal/gateway/")
}

// lingeringSessions is an API session service whose handler, once its
// stream ends, keeps running until released, as the API's does while it
// writes a session's end to its store.
type lingeringSessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	ending, release chan struct{}
	finished        atomic.Bool
}

func (f *lingeringSessions) Connect(ctx context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: fakeNonce}}}); err != nil {
		return nil
	}
	if _, err := s.Receive(); err != nil {
		return nil
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{NodeId: "node_01"}}}); err != nil {
		return nil
	}
	<-ctx.Done()
	close(f.ending)
	<-f.release
	f.finished.Store(true)
	return nil
}

// The in-process gateway's Shutdown returns only once the API's handlers
// it runs have returned (serve closes the store right after): it is still
// waiting while a session's handler finishes, and returns once it did.
func TestInProcessShutdownWaitsForTheAPIsHandlers(t *testing.T) {
	onBothServers(t, testInProcessShutdownWaitsForTheAPIsHandlers)
}

func testInProcessShutdownWaitsForTheAPIsHandlers(t *testing.T, e *env) {
	f := &lingeringSessions{ending: make(chan struct{}), release: make(chan struct{})}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewSessionServiceHandler(f))
	g, addr := startGatewayWith(t, e.localConfig(), Options{Log: quietLog(), LocalAPI: mux})
	s, tr, err := openSession(context.Background(), e, addr, nil, e.nodeCert(t, "node_01"))
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.CloseResponse() }()
	shut := make(chan error, 1)
	go func() { shut <- g.Shutdown(context.Background()) }()
	<-f.ending
	// Shutdown must now be waiting for its tasks, never returned.
	poll.Until(t, 30*time.Second, "Shutdown waiting for the API's handler", func() bool {
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned (%v) while the API's handler still ran", err)
		default:
		}
		return waitingInClose()
	})
	close(f.release)
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if !f.finished.Load() {
		t.Fatal("Shutdown returned before the API's handler did")
	}
}

// waitingInClose reports whether a goroutine is blocked in
// the gateway's tasks.Tracker.Close.
func waitingInClose() bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Contains(string(buf[:n]), "tasks.(*Tracker).Close")
		}
		buf = make([]byte, 2*len(buf))
	}
}
