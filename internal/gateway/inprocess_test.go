package gateway

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
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
	"github.com/better-compute/better-compute/internal/shared/tasks"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// localConfig is a gateway config for the API's process: no api_url.
func (e *env) localConfig() Config {
	return Config{Listen: "127.0.0.1:0", CertFile: e.certFile, KeyFile: e.keyFile, DaemonHTTP2: e.kind}
}

// seen records how requests reached an in-process API handler.
type seen struct {
	mu   sync.Mutex
	reqs []*http.Request
}

func (s *seen) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		s.reqs = append(s.reqs, r)
		s.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

// R13.2, R12.1: in the API's process the API sees what it sees over the
// network from a relay: the daemon's address and presented leaf in the
// Bc-Peer-* headers the gateway sets, never a daemon's own Bc-Peer-* or
// other headers, and no header the network path does not carry either.
func TestInProcessHeadersAsOverTheNetworkR13_2(t *testing.T) {
	e := newEnv(t)
	f := newFakeAPI(t, e)
	_, netGW := startGateway(t, e.config(f.URL()))
	path, h := agentv1connect.NewJoinServiceHandler(f)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	var s seen
	_, localGW := startGatewayWith(t, e.localConfig(), Options{Log: quietLog(), LocalAPI: s.wrap(mux)})
	nodeCert := e.nodeCert(t, "node_01")
	forged := e.nodeCert(t, "node_evil")

	// smuggle sets what a hostile daemon sends beside its call.
	smuggle := func(h http.Header) {
		h.Set(wire.PeerAddrHeader, "10.6.6.6:1")
		h.Set(wire.PeerCertificateHeader, base64.StdEncoding.EncodeToString(forged.Certificate[0]))
		h.Set("Bc-Peer-Tenant", "root")
		h.Set("X-Smuggled", "1")
	}
	// call joins and renews through gw as one daemon; it returns the
	// headers the API saw on each, and the daemon's address.
	call := func(t *testing.T, gw string) ([]http.Header, string) {
		d := newDaemon(t, e, gw, nodeCert)
		join := connect.NewRequest(joinRequest("eyJhbGciOiJFQ0RILUVTK0EyNTZLVyJ9.a.b.c.d"))
		smuggle(join.Header())
		if _, err := d.client.Join(context.Background(), join); err != nil {
			t.Fatalf("join: %v", err)
		}
		joined := f.last(t).header
		renew := connect.NewRequest(&agentv1.RenewRequest{Csr: []byte{1}, NodeId: "node_01"})
		smuggle(renew.Header())
		if _, err := d.client.Renew(context.Background(), renew); err != nil {
			t.Fatalf("renew: %v", err)
		}
		return []http.Header{joined, f.last(t).header}, d.addr()
	}
	overNet, _ := call(t, netGW)
	local, daemonAddr := call(t, localGW)

	leaf := base64.StdEncoding.EncodeToString(nodeCert.Certificate[0])
	for i, name := range []string{"join", "renew"} {
		got := local[i]
		if v := got.Values(wire.PeerAddrHeader); len(v) != 1 || v[0] != daemonAddr {
			t.Errorf("%s: %s = %q, want the daemon's address %q", name, wire.PeerAddrHeader, v, daemonAddr)
		}
		wantCert := []string(nil)
		if name == "renew" {
			wantCert = []string{leaf} // the presented leaf, not the forged header
		}
		if v := got.Values(wire.PeerCertificateHeader); !slices.Equal(v, wantCert) {
			t.Errorf("%s: %s = %q, want %q", name, wire.PeerCertificateHeader, v, wantCert)
		}
		for k, v := range got {
			if strings.HasPrefix(k, wire.PeerHeaderPrefix) && k != wire.PeerAddrHeader && k != wire.PeerCertificateHeader {
				t.Errorf("%s: the API got %s = %q from the daemon", name, k, v)
			}
			if k == "X-Smuggled" {
				t.Errorf("%s: the API got the daemon's %s = %q", name, k, v)
			}
			if _, ok := overNet[i][k]; !ok {
				t.Errorf("%s: in process the API got %s = %q, which the network path does not carry", name, k, v)
			}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.reqs) != 2 {
		t.Fatalf("the in-process API saw %d requests, want 2", len(s.reqs))
	}
	for _, r := range s.reqs {
		if r.TLS != nil || r.RemoteAddr != localRemoteAddr || r.ProtoMajor != 2 {
			t.Errorf("request TLS %v, RemoteAddr %q, HTTP/%d: want no TLS, %q, HTTP/2", r.TLS, r.RemoteAddr, r.ProtoMajor, localRemoteAddr)
		}
	}
}

type stream = *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]

// R12.1, R12.3: a session relayed in memory streams both ways (the API's
// Challenge first, commands down, the gateway's refusal of a kind up), and
// its end at the daemon ends it at the API, however it ends.
func TestInProcessSessionR12_1(t *testing.T) {
	e := newEnv(t)
	tests := []struct {
		name string
		end  func(t *testing.T, g *Gateway, s stream, conn net.Conn)
	}{
		// Go's client resets a stream whose request is still open only
		// when its response body is closed, not on its context alone.
		{"the daemon resets its stream", func(_ *testing.T, _ *Gateway, s stream, _ net.Conn) { _ = s.CloseResponse() }},
		{"the daemon ends its side", func(_ *testing.T, _ *Gateway, s stream, _ net.Conn) { _ = s.CloseRequest() }},
		{"the daemon's connection drops", func(_ *testing.T, _ *Gateway, _ stream, conn net.Conn) { _ = conn.Close() }},
		{"the gateway shuts down", func(t *testing.T, g *Gateway, _ stream, _ net.Conn) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := g.Shutdown(ctx); err != nil {
				t.Errorf("shutdown: %v", err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeSessions{allowed: []string{"node.*"}, results: make(chan *agentv1.CommandResult, 4),
				commands: []*agentv1.SignedCommand{signedCommand(t, "c1", "shell.exec"), signedCommand(t, "c2", "node.facts")}}
			path, h := agentv1connect.NewSessionServiceHandler(f)
			mux := http.NewServeMux()
			mux.Handle(path, h)
			g, gw := startGatewayWith(t, e.localConfig(), Options{Log: quietLog(), LocalAPI: mux})
			var conn net.Conn
			tr := &http.Transport{ForceAttemptHTTP2: true,
				TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: []tls.Certificate{e.nodeCert(t, "node_01")}},
				DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
					c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
					conn = c
					return c, err
				}}
			defer tr.CloseIdleConnections()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+gw, connect.WithGRPC()).Connect(ctx)
			if err := s.Send(nil); err != nil {
				t.Fatal(err)
			}
			if m, err := s.Receive(); err != nil || m.GetChallenge() == nil {
				t.Fatalf("first answer %v (%v), want the API's Challenge", m, err)
			}
			if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: fakeProof}}}); err != nil {
				t.Fatal(err)
			}
			if m, err := s.Receive(); err != nil || m.GetWelcome() == nil {
				t.Fatalf("second answer %v (%v), want Welcome", m, err)
			}
			m, err := s.Receive()
			var body agentv1.CommandBody
			if err != nil || proto.Unmarshal(m.GetCommand().GetBody(), &body) != nil || body.GetCommandId() != "c2" {
				t.Fatalf("daemon got %v (%v), want command c2", m, err)
			}
			if r := <-f.results; r.GetCommandId() != "c1" || r.GetOk() || r.GetError() != wire.GatewayKindRefused {
				t.Errorf("API got result %v, want c1 refused at the gateway", r)
			}
			f.mu.Lock()
			certs, proofs := slices.Clone(f.certs), slices.Clone(f.proofs)
			f.mu.Unlock()
			if len(certs) != 1 || certs[0] == "" || len(proofs) != 1 || string(proofs[0]) != string(fakeProof) {
				t.Errorf("the API saw certificates %q and proofs %x, want the daemon's leaf and its proof unchanged", certs, proofs)
			}
			if f.open.Load() != 1 {
				t.Fatalf("API streams %d, want 1", f.open.Load())
			}
			tc.end(t, g, s, conn)
			waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 })
		})
	}
}

// The transport itself: the caller's cancellation ends the handler's
// context and unblocks its read of a request body still open; closing the
// response body early does the same; a handler that panics before its
// headers fails the call; trailers arrive after the body.
func TestLocalTransport(t *testing.T) {
	type handlerEnd struct {
		ctxErr  error
		readErr error
	}
	// blocking reads the request body until it fails, then reports why
	// and how its context ended.
	blocking := func(ends chan<- handlerEnd) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			_, err := io.Copy(io.Discard, r.Body)
			<-r.Context().Done()
			ends <- handlerEnd{ctxErr: r.Context().Err(), readErr: err}
		})
	}
	open := func(t *testing.T, h http.Handler) (*http.Response, context.CancelFunc, *io.PipeWriter) {
		ctx, cancel := context.WithCancel(context.Background())
		pr, pw := io.Pipe()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, LocalAPIURL+"/stream", pr)
		if err != nil {
			t.Fatal(err)
		}
		res, err := localTransport{h: h, tasks: new(tasks.Tracker)}.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		return res, cancel, pw
	}
	t.Run("the caller cancels", func(t *testing.T) {
		ends := make(chan handlerEnd, 1)
		res, cancel, pw := open(t, blocking(ends))
		defer pw.Close()
		cancel()
		end := <-ends
		if end.ctxErr == nil || end.readErr == nil {
			t.Errorf("handler context %v, body read %v: want both ended", end.ctxErr, end.readErr)
		}
		if _, err := res.Body.Read(make([]byte, 1)); !errors.Is(err, context.Canceled) {
			t.Errorf("the caller reads %v, want context.Canceled", err)
		}
	})
	t.Run("the caller closes the response body", func(t *testing.T) {
		ends := make(chan handlerEnd, 1)
		res, cancel, pw := open(t, blocking(ends))
		defer cancel()
		defer pw.Close()
		_ = res.Body.Close()
		if end := <-ends; end.ctxErr == nil || end.readErr == nil {
			t.Errorf("handler context %v, body read %v: want both ended", end.ctxErr, end.readErr)
		}
		if _, err := pw.Write([]byte{1}); err == nil {
			t.Error("the caller's write to the request body succeeded after the stream ended")
		}
	})
	t.Run("a handler panics before its headers", func(t *testing.T) {
		req := httptest.NewRequest(http.MethodPost, LocalAPIURL+"/x", nil)
		_, err := localTransport{h: http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic(http.ErrAbortHandler) }), tasks: new(tasks.Tracker)}.RoundTrip(req)
		if !errors.Is(err, errAborted) {
			t.Errorf("RoundTrip = %v, want %v", err, errAborted)
		}
	})
	t.Run("trailers", func(t *testing.T) {
		h := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Trailer", "Grpc-Status")
			w.Header().Set("Content-Type", "application/grpc")
			_, _ = w.Write([]byte("body"))
			w.Header().Set("Grpc-Status", "0")
			w.Header().Set(http.TrailerPrefix+"Grpc-Message", "ok")
		})
		res, err := localTransport{h: h, tasks: new(tasks.Tracker)}.RoundTrip(httptest.NewRequest(http.MethodPost, LocalAPIURL+"/x", nil))
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(res.Body)
		if err != nil || string(b) != "body" {
			t.Fatalf("body %q %v", b, err)
		}
		_ = res.Body.Close()
		if res.StatusCode != 200 || res.Header.Get("Content-Type") != "application/grpc" || res.Header.Get("Grpc-Status") != "" ||
			res.Trailer.Get("Grpc-Status") != "0" || res.Trailer.Get("Grpc-Message") != "ok" {
			t.Errorf("status %d, header %v, trailer %v", res.StatusCode, res.Header, res.Trailer)
		}
	})
}

// R17.2: an in-process gateway is ready while the API's /readyz answers
// (asked in memory), and says why not otherwise.
func TestInProcessReadinessR17_2(t *testing.T) {
	e := newEnv(t)
	var down atomic.Bool
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if down.Load() {
			http.Error(w, "the database is unavailable", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	g, err := New(e.localConfig(), Options{Log: quietLog(), LocalAPI: mux})
	if err != nil {
		t.Fatal(err)
	}
	ready := func() (int, string) {
		rec := httptest.NewRecorder()
		g.DiagnosticsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		return rec.Code, rec.Body.String()
	}
	if code, body := ready(); code != http.StatusOK {
		t.Errorf("ready: %d %q, want 200", code, body)
	}
	down.Store(true)
	if code, body := ready(); code != http.StatusServiceUnavailable || !strings.Contains(body, LocalAPIURL+": 503 Service Unavailable") {
		t.Errorf("API not ready: %d %q, want 503 naming the in-process API", code, body)
	}
}

// In the API's process the keys that name an agent listener, and the
// gateway's own log and traces, are refused, naming the key.
func TestValidateInProcess(t *testing.T) {
	e := newEnv(t)
	ratio := 0.5
	tests := []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"api_url", func(c *Config) { c.APIURL = "https://api:8444" }, "api_url"},
		{"api_urls", func(c *Config) { c.APIURLs = []string{"https://api:8444"} }, "api_urls"},
		{"api_ca_file", func(c *Config) { c.APICAFile = e.caFile }, "api_ca_file"},
		{"log", func(c *Config) { c.Log.Format = "json" }, "log"},
		{"tracing", func(c *Config) { c.Tracing.SampleRatio = &ratio }, "tracing"},
		{"session_relay", func(c *Config) { c.DaemonHTTP2, c.SessionRelay = DaemonHTTP2Framer, SessionRelayCallbacks }, "session_relay"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := e.localConfig()
			tc.edit(&c)
			err := c.ValidateInProcess()
			var pe *errs.E
			if !errors.As(err, &pe) || pe.Code != errs.InvalidConfig || pe.Field != tc.field {
				t.Fatalf("ValidateInProcess = %v, want INVALID_CONFIG naming %s", err, tc.field)
			}
		})
	}
	c := e.localConfig()
	if err := c.ValidateInProcess(); err != nil || c.MaxSessions != DefaultMaxSessions {
		t.Errorf("ValidateInProcess = %v (max_sessions %d), want nil and the defaults", err, c.MaxSessions)
	}
	// The framer serves the daemons here too; sessions go through the
	// goroutine relay, the only one to an API in memory.
	if c.DaemonHTTP2 != DaemonHTTP2Framer || c.SessionRelay != SessionRelayGoroutines {
		t.Errorf("in the API's process: daemon_http2 %q, session_relay %q; want framer, goroutines", c.DaemonHTTP2, c.SessionRelay)
	}
	if _, err := New(e.localConfig(), Options{Log: quietLog()}); err == nil {
		t.Error("New without LocalAPI and without api_url succeeded")
	}
}

// BenchmarkRelayJoinInProcess is BenchmarkRelayJoin with the gateway in
// the API's process: the same relay, the fake API's handler called in
// memory instead of over a loopback mTLS HTTP/2 connection.
func BenchmarkRelayJoinInProcess(b *testing.B) { benchmarkRelayJoin(b, nil, true) }
