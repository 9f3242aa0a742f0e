package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/wire"
)

// fakeSessions is the API's SessionService reduced to holding streams: it
// answers Hello with Welcome and reads until the stream ends. It refuses a
// stream without Bc-Peer-Certificate, as the API does.
type fakeSessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	mu    sync.Mutex
	certs []string
	// direct accepts streams without the header (the memory baseline).
	direct bool
}

func (f *fakeSessions) Connect(ctx context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	cert := s.RequestHeader().Get(HeaderPeerCertificate)
	f.mu.Lock()
	f.certs = append(f.certs, cert)
	f.mu.Unlock()
	if cert == "" && !f.direct {
		return wire.ToWire(quietLog(), "Connect", errs.New(errs.AccessDenied, "Session refused"))
	}
	m, err := s.Receive()
	if err != nil || m.GetHello() == nil {
		return wire.ToWire(quietLog(), "Connect", errs.New(errs.AccessDenied, "Session refused"))
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{NodeId: "node_01", HeartbeatSeconds: 15}}}); err != nil {
		return nil
	}
	for {
		if _, err := s.Receive(); err != nil {
			return nil
		}
	}
}

// startSessionAPI serves fakeSessions over mTLS like the agent listener.
func startSessionAPI(t testing.TB, e *env) (*fakeSessions, string) {
	t.Helper()
	f := &fakeSessions{}
	path, h := agentv1connect.NewSessionServiceHandler(f)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return f, srv.URL
}

// openSession dials gw as its own daemon (own TLS connection) and
// completes Hello/Welcome.
func openSession(ctx context.Context, e *env, addr string, certs ...tls.Certificate) (*connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage], *http.Transport, error) {
	tr := &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: certs}}
	c := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+addr, connect.WithGRPC())
	s := c.Connect(ctx)
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1}}}); err != nil && !errors.Is(err, io.EOF) {
		return s, tr, err
	}
	m, err := s.Receive()
	if err == nil && m.GetWelcome() == nil {
		err = errors.New("first answer is not Welcome")
	}
	return s, tr, err
}

// R12.1: the gateway relays a session with the daemon's certificate and
// refuses one without a certificate before reaching the API.
func TestSessionRelay(t *testing.T) {
	e := newEnv(t)
	f, apiURL := startSessionAPI(t, e)
	_, gw := startGateway(t, e.config(apiURL))
	cert := e.nodeCert(t, "node_01")
	tests := []struct {
		name     string
		certs    []tls.Certificate
		wantCode errs.Code
	}{
		{name: "with a node certificate", certs: []tls.Certificate{cert}},
		{name: "without a certificate", wantCode: errs.AccessDenied},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f.mu.Lock()
			before := len(f.certs)
			f.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, tr, err := openSession(ctx, e, gw, tc.certs...)
			defer tr.CloseIdleConnections()
			if tc.wantCode != "" {
				if pe := productError(t, err); pe.Code != tc.wantCode || pe.Message != "Session refused" {
					t.Fatalf("got %v", pe)
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				if len(f.certs) != before {
					t.Errorf("a session without a certificate reached the API")
				}
				return
			}
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			// Heartbeats flow; ending the daemon side ends the API side.
			if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}}); err != nil {
				t.Fatal(err)
			}
			_ = s.CloseRequest()
			if _, err := s.Receive(); !errors.Is(err, io.EOF) {
				t.Errorf("after the daemon closed, Receive = %v, want EOF", err)
			}
		})
	}
}

// TestSessionMemory measures the gateway's heap per held session
// (BC_SESSION_MEM=N, e.g. 2000): N daemons, each on its own TLS
// connection, first straight to the fake API, then through the gateway;
// the difference in HeapInuse divided by N is the gateway's share.
func TestSessionMemory(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("BC_SESSION_MEM"))
	if n <= 0 {
		t.Skip("set BC_SESSION_MEM=N to measure")
	}
	e := newEnv(t)
	f, apiURL := startSessionAPI(t, e)
	f.direct = true
	cert := e.nodeCert(t, "node_01")
	gwCert, err := tls.LoadX509KeyPair(e.certFile, e.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config(apiURL)
	_, gw := startGateway(t, cfg)
	apiAddr := apiURL[len("https://"):]

	measure := func(addr string, cert tls.Certificate) uint64 {
		ctx, cancel := context.WithCancel(context.Background())
		base := heapInuse()
		var trs []*http.Transport
		for i := 0; i < n; i++ {
			_, tr, err := openSession(ctx, e, addr, cert)
			if err != nil {
				t.Fatalf("session %d: %v", i, err)
			}
			trs = append(trs, tr)
		}
		held := heapInuse()
		cancel()
		for _, tr := range trs {
			tr.CloseIdleConnections()
		}
		time.Sleep(500 * time.Millisecond)
		if held < base {
			return 0
		}
		return held - base
	}
	direct := measure(apiAddr, gwCert) // the API requires a serving-CA client certificate
	viaGW := measure(gw, cert)
	per := int64(viaGW-direct) / int64(n)
	t.Logf("sessions %d: direct %d B/session, via gateway %d B/session, gateway share %d B/session (%.1f MiB per 10k sessions)",
		n, direct/uint64(n), viaGW/uint64(n), per, float64(per)*10000/(1<<20))
}

func heapInuse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}
