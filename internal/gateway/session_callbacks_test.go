package gateway

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
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
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
	"github.com/better-compute/better-compute/internal/shared/wire"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// Past max_sessions a new session is refused at once with
// RESOURCE_EXHAUSTED and the "gateway full" line; a session that ends
// frees its slot.
func TestSessionsHeldLimit(t *testing.T) { onEverySessionSide(t, testSessionsHeldLimit) }

func testSessionsHeldLimit(t *testing.T, e *env) {
	f, apiURL := startSessionAPI(t, e)
	logs := &wiretest.LogBuffer{}
	cfg := e.config(apiURL)
	cfg.MaxSessions = 1
	g, gw := startGatewayWith(t, cfg, Options{Log: slog.New(slog.NewJSONHandler(logs, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cert := e.nodeCert(t, "node_01")
	s1, tr1, err := openSession(ctx, e, gw, nil, cert)
	defer tr1.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	_, tr2, err := openSession(ctx, e, gw, nil, cert)
	tr2.CloseIdleConnections()
	if pe := productError(t, err); pe.Code != errs.ResourcesLimited || pe.Message != "the gateway is busy; retry later" {
		t.Fatalf("the session past max_sessions got %v, want RESOURCES_LIMITED", pe)
	}
	if n := len(logs.Lines(t, "gateway full: session refused", map[string]any{"max_sessions": float64(1)})); n != 1 {
		t.Errorf("%d \"gateway full\" lines, want 1", n)
	}
	if n := f.open.Load(); n != 1 {
		t.Errorf("the API holds %d streams, want 1", n)
	}
	_ = s1.CloseRequest()
	if _, err := s1.Receive(); !errors.Is(err, io.EOF) {
		t.Errorf("after the daemon closed, Receive = %v, want EOF", err)
	}
	_ = s1.CloseResponse()
	waitFor(t, 10*time.Second, func() bool { return len(g.held) == 0 })
	s3, tr3, err := openSession(ctx, e, gw, nil, cert)
	defer tr3.CloseIdleConnections()
	if err != nil {
		t.Fatalf("a session after the first ended: %v", err)
	}
	_ = s3.CloseRequest()
	_ = s3.CloseResponse()
	if n := telemetrytest.Gather(t, g.Registry()).Get(telemetry.GatewaySessionsOpened); n != 2 {
		t.Errorf("sessions opened %v, want 2 (the refused one is not)", n)
	}
}

// The API's refusal of a session, at once or after Welcome, reaches the
// daemon as the API said it (code, message, product code), and is no
// relay error.
func TestSessionAPIRefusalRelayed(t *testing.T) { onEverySessionSide(t, testSessionAPIRefusalRelayed) }

func testSessionAPIRefusalRelayed(t *testing.T, e *env) {
	f, apiURL := startSessionAPI(t, e)
	g, gw := startGateway(t, e.config(apiURL))
	refusal := wire.ErrNodeRetired()
	for _, at := range []string{"at once", "after Welcome"} {
		t.Run(at, func(t *testing.T) {
			f.mu.Lock()
			f.refuse, f.endAfter = nil, nil
			if at == "at once" {
				f.refuse = refusal
			} else {
				f.endAfter = refusal
			}
			f.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
			defer tr.CloseIdleConnections()
			if at == "after Welcome" {
				if err != nil {
					t.Fatalf("open: %v", err)
				}
				_, err = s.Receive()
			}
			if pe := productError(t, err); pe.Code != refusal.Code || pe.Message != refusal.Message {
				t.Errorf("the daemon got %v, want %v", pe, refusal)
			}
			if !wire.IsNodeRetired(err) {
				t.Errorf("the daemon does not read %v as its node retired", err)
			}
			_ = s.CloseResponse()
			waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 && len(g.held) == 0 })
		})
	}
	v := telemetrytest.Gather(t, g.Registry())
	if n := v.Get(telemetry.GatewayRelayErrors, telemetry.LabelUpstream, apiURL); n != 0 {
		t.Errorf("relay errors %v, want none: the API answered", n)
	}
}

// killableReplica is an API replica (replicaMux) the test can kill: its
// listener and connections closed, as a process that died.
type killableReplica struct {
	srv      *httptest.Server
	sessions *fakeSessions
}

func startKillableReplica(t *testing.T, e *env) *killableReplica {
	t.Helper()
	h, s := replicaMux(e)
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = agentListenerHTTP2()
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return &killableReplica{srv: srv, sessions: s}
}

func (r *killableReplica) kill() {
	_ = r.srv.Listener.Close()
	r.srv.CloseClientConnections()
}

// R19.2: a replica that dies under a held session ends it with
// UNAVAILABLE (a relay error of that replica), and the daemon's next
// session goes to the replica still alive.
func TestSessionReplicaKilled(t *testing.T) { onEverySessionSide(t, testSessionReplicaKilled) }

func testSessionReplicaKilled(t *testing.T, e *env) {
	reps := []*killableReplica{startKillableReplica(t, e), startKillableReplica(t, e)}
	cfg := e.config("")
	cfg.APIURLs = []string{reps[0].srv.URL, reps[1].srv.URL}
	g, gw := startGateway(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cert := e.nodeCert(t, "node_01")
	s, tr, err := openSession(ctx, e, gw, nil, cert)
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	dead, alive := reps[0], reps[1]
	if alive.sessions.open.Load() == 1 {
		dead, alive = alive, dead
	}
	if dead.sessions.open.Load() != 1 {
		t.Fatal("no replica holds the session")
	}
	dead.kill()
	if _, err := s.Receive(); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("after its replica died, Receive = %v, want UNAVAILABLE", err)
	}
	_ = s.CloseResponse()
	if n := telemetrytest.Gather(t, g.Registry()).Get(telemetry.GatewayRelayErrors, telemetry.LabelUpstream, dead.srv.URL); n < 1 {
		t.Errorf("relay errors of the dead replica %v, want at least 1", n)
	}
	// bcd reconnects; a session may still be sent to the dead replica
	// until it is taken out (its failure does that), then not.
	poll.Until(t, 20*time.Second, "a new session on the live replica", func() bool {
		s2, tr2, err := openSession(ctx, e, gw, nil, cert)
		defer tr2.CloseIdleConnections()
		if err == nil {
			_ = s2.CloseRequest()
			_ = s2.CloseResponse()
		}
		return err == nil
	})
}

// floodSessions is an API session service that, after Welcome, sends n
// commands of size bytes as fast as the stream takes them, counting
// them.
type floodSessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	n, size int
	sent    atomic.Int64
	done    atomic.Bool
}

func (f *floodSessions) Connect(_ context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: fakeNonce}}}); err != nil {
		return nil
	}
	if _, err := s.Receive(); err != nil {
		return nil
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{NodeId: "node_01"}}}); err != nil {
		return nil
	}
	body := bytes.Repeat([]byte{0x42}, f.size)
	for i := range f.n {
		if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: &agentv1.SignedCommand{Body: body, Sig: []byte{byte(i)}}}}); err != nil {
			return nil
		}
		f.sent.Add(1)
	}
	f.done.Store(true)
	for {
		if _, err := s.Receive(); err != nil {
			return nil
		}
	}
}

// floodBlocked reports whether floodSessions' handler is waiting in a
// Send (for the stream's window).
func floodBlocked() bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "(*floodSessions).Connect") {
			head, _, _ := strings.Cut(g, "\n")
			return strings.Contains(g, ").Send(") && !strings.Contains(head, "running")
		}
	}
	return false
}

// A daemon that does not read holds the API back through the relay's
// flow control: the gateway passes a message's window back only once the
// daemon took it, so what the API can send is bounded by the windows
// (about 64 KiB a side), not buffered at the gateway; once the daemon
// reads, everything arrives, in order.
func TestSessionCallbacksSlowDaemon(t *testing.T) {
	e := newEnv(t)
	sessionSide{DaemonHTTP2Framer, SessionRelayCallbacks}.apply(e)
	const n, size = 100, 16 << 10
	f := &floodSessions{n: n, size: size}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewSessionServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = agentListenerHTTP2()
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	_, gw := startGateway(t, e.config(srv.URL))
	// The daemon's own window: 64 KiB, taken back only as it reads.
	tr := &http.Transport{ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: []tls.Certificate{e.nodeCert(t, "node_01")}},
		HTTP2:           &http.HTTP2Config{MaxReceiveBufferPerStream: 64 << 10}}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := openSessionOn(ctx, tr, gw)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.CloseResponse() }()
	// Wait until the API is held in a Send and stays there (or, were
	// there no back-pressure, until it sent everything).
	poll.Until(t, 30*time.Second, "the API held back or done", func() bool {
		if f.done.Load() {
			return true
		}
		sent := f.sent.Load()
		if sent < 2 || !floodBlocked() {
			return false
		}
		time.Sleep(200 * time.Millisecond)
		return f.sent.Load() == sent && floodBlocked()
	})
	if f.done.Load() {
		t.Fatalf("the API sent all %d messages to a daemon that read none", n)
	}
	if sent := f.sent.Load(); sent*size > 256<<10 {
		t.Fatalf("the API sent %d messages of %d bytes to a daemon that read none, want them held back by the windows", sent, size)
	}
	for i := range n {
		m, err := s.Receive()
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
		if sig := m.GetCommand().GetSig(); len(sig) != 1 || sig[0] != byte(i) || len(m.GetCommand().GetBody()) != size {
			t.Fatalf("message %d is not the API's %dth", i, i)
		}
	}
	waitFor(t, 10*time.Second, f.done.Load)
}

// With callbacks: a gRPC session offering compression is refused
// UNIMPLEMENTED before its body is read (R15.4); a message over
// max_body_bytes from the daemon ends its session RESOURCES_LIMITED and
// the upstream stream with it; one from the API ends it UNAVAILABLE.
func TestSessionCallbacksLimits(t *testing.T) {
	e := newEnv(t)
	sessionSide{DaemonHTTP2Framer, SessionRelayCallbacks}.apply(e)
	f, apiURL := startSessionAPI(t, e)
	cfg := e.config(apiURL)
	cfg.MaxBodyBytes = 4 << 10
	_, gw := startGateway(t, cfg)

	hc := &http.Client{Transport: &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots,
		Certificates: []tls.Certificate{e.nodeCert(t, "node_01")}}}}
	defer hc.CloseIdleConnections()
	c := wiretest.RawCall{Path: agentv1connect.SessionServiceConnectProcedure, Protocol: "grpc", ContentType: "application/grpc", Gzip: true,
		Body: []byte("compressed")}
	if got := c.Do(t, hc, "https://"+gw); got != "grpc-status 12" {
		t.Errorf("a compressed session: %q, want grpc-status 12 (UNIMPLEMENTED)", got)
	}
	f.mu.Lock()
	reached := len(f.certs)
	f.mu.Unlock()
	if reached != 0 {
		t.Errorf("a compressed session reached the API")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	big := &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: &agentv1.CommandResult{CommandId: "c1", Error: strings.Repeat("x", 8<<10)}}}
	if err := s.Send(big); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if _, err := s.Receive(); productError(t, err).Code != errs.ResourcesLimited {
		t.Errorf("after a message over max_body_bytes, Receive = %v, want RESOURCES_LIMITED", err)
	}
	_ = s.CloseResponse()
	waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 })

	f.mu.Lock()
	f.commands = []*agentv1.SignedCommand{{Body: bytes.Repeat([]byte{1}, 8<<10)}}
	f.mu.Unlock()
	s, tr2, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
	defer tr2.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Receive(); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("after the API's message over max_body_bytes, Receive = %v, want UNAVAILABLE", err)
	}
	_ = s.CloseResponse()
	waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 })
}

// grpcTrailers encodes a product error as connect's gRPC handler does: a
// connect client reads back the code, the message (percent-encoded on the
// wire) and the product code.
func TestGRPCTrailersRoundTrip(t *testing.T) {
	for _, e := range []*errs.E{
		errs.New(errs.AccessDenied, "Session refused"),
		errs.New(errs.Unavailable, "%s", "100% busy: ünïcode\nand a newline"),
	} {
		tr := wire.GRPCTrailers(wire.ToWire(quietLog(), "p", e))
		got := roundTripTrailers(t, tr)
		pe, ok := errs.As(wire.FromWire(got))
		if !ok || pe.Code != e.Code || pe.Message != e.Message {
			t.Errorf("%v: read back %v", e, got)
		}
	}
}

// roundTripTrailers answers a connect gRPC client with trailers tr and
// returns its error.
func roundTripTrailers(t *testing.T, tr http.Header) error {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/grpc")
		w.WriteHeader(http.StatusOK)
		for k, v := range tr {
			w.Header()[http.TrailerPrefix+k] = v
		}
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	defer srv.Close()
	c := agentv1connect.NewJoinServiceClient(srv.Client(), srv.URL, connect.WithGRPC())
	_, err := c.Keys(context.Background(), connect.NewRequest(&agentv1.KeysRequest{}))
	return err
}
