package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

func signedCommand(t *testing.T, id, kind string) *agentv1.SignedCommand {
	t.Helper()
	body, err := proto.Marshal(&agentv1.CommandBody{CommandId: id, NodeId: "node_01", Kind: kind})
	if err != nil {
		t.Fatal(err)
	}
	return &agentv1.SignedCommand{Body: body, Sig: []byte("sig")}
}

// R7.5: the gateway forwards only the kinds named in Welcome.allowed_kinds
// (exact or prefix.*; none named: every kind) and answers the API for a
// refused command with a failed CommandResult.
func TestSessionKindsAtDispatch(t *testing.T) { forSessionSides(t, testSessionKindsAtDispatch) }

func testSessionKindsAtDispatch(t *testing.T, side sessionSide) {
	tests := []struct {
		name      string
		allowed   []string
		forwarded []string // command ids the daemon receives, in order
		refused   []string // command ids the API hears back as refused
	}{
		{name: "prefix and exact kinds", allowed: []string{"node.*", "acceptance.check"},
			forwarded: []string{"c2", "c3", "c5"}, refused: []string{"c1", "c4"}},
		{name: "no restriction", forwarded: []string{"c1", "c2", "c3", "c4", "c5"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			side.apply(e)
			f, apiURL := startSessionAPI(t, e)
			f.allowed = tc.allowed
			f.results = make(chan *agentv1.CommandResult, 8)
			f.commands = []*agentv1.SignedCommand{
				signedCommand(t, "c1", "shell.exec"),
				signedCommand(t, "c2", "node.facts"),
				signedCommand(t, "c3", "acceptance.check"),
				signedCommand(t, "c4", "nodes.facts"), // not node.*
				signedCommand(t, "c5", "node.reboot.now"),
			}
			_, gw := startGateway(t, e.config(apiURL))
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
			defer tr.CloseIdleConnections()
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = s.CloseResponse() }()
			defer func() { _ = s.CloseRequest() }()
			for _, want := range tc.forwarded {
				m, err := s.Receive()
				if err != nil {
					t.Fatalf("want command %s: %v", want, err)
				}
				var body agentv1.CommandBody
				if err := proto.Unmarshal(m.GetCommand().GetBody(), &body); err != nil || body.GetCommandId() != want {
					t.Fatalf("daemon got %v (%v), want command %s", &body, err, want)
				}
			}
			for _, want := range tc.refused {
				select {
				case r := <-f.results:
					if r.GetCommandId() != want || r.GetOk() || r.GetError() != wire.GatewayKindRefused {
						t.Errorf("API got result %v, want %s failed with %q", r, want, wire.GatewayKindRefused)
					}
				case <-ctx.Done():
					t.Fatalf("no result for refused command %s", want)
				}
			}
			select {
			case r := <-f.results:
				t.Errorf("unexpected result %v", r)
			default:
			}
		})
	}
}

// A daemon that vanishes (its connection dropped, no end of stream) ends
// its upstream stream at the API.
func TestSessionDaemonVanishes(t *testing.T) { onEverySessionSide(t, testSessionDaemonVanishes) }

func testSessionDaemonVanishes(t *testing.T, e *env) {
	f, apiURL := startSessionAPI(t, e)
	_, gw := startGateway(t, e.config(apiURL))
	var conn net.Conn
	tr := &http.Transport{ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: []tls.Certificate{e.nodeCert(t, "node_01")}},
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			conn = c
			return c, err
		}}
	c := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+gw, connect.WithGRPC())
	s := c.Connect(context.Background())
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Receive(); err != nil {
		t.Fatal(err)
	}
	if f.open.Load() != 1 {
		t.Fatalf("API streams %d, want 1", f.open.Load())
	}
	_ = conn.Close()
	waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 })
}

// Shutdown ends held sessions at once (UNAVAILABLE to the daemon, the
// upstream stream ended) instead of waiting for them.
func TestSessionShutdown(t *testing.T) { onEverySessionSide(t, testSessionShutdown) }

func testSessionShutdown(t *testing.T, e *env) {
	f, apiURL := startSessionAPI(t, e)
	g, gw := startGateway(t, e.config(apiURL))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.CloseResponse() }()
	start := time.Now()
	if err := g.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("shutdown took %s with a session held", d)
	}
	if _, err := s.Receive(); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("daemon Receive after shutdown = %v, want UNAVAILABLE", err)
	}
	waitFor(t, 10*time.Second, func() bool { return f.open.Load() == 0 })
}

func waitFor(t *testing.T, d time.Duration, ok func() bool) {
	t.Helper()
	poll.Until(t, d, "the relay's condition", ok)
}

// A session outlives the per-request read timeout (request_timeout + 10
// s): the relay lifts it on both servers.
func TestSessionOutlivesTheReadTimeout(t *testing.T) {
	onEverySessionSide(t, testSessionOutlivesTheReadTimeout)
}

func testSessionOutlivesTheReadTimeout(t *testing.T, e *env) {
	_, apiURL := startSessionAPI(t, e)
	clk := clock.NewFake(testNow)
	cfg := e.config(apiURL)
	_, gw := startGatewayWith(t, cfg, Options{Log: quietLog(), Clock: clk})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	// Past the read deadline, short of the keepalive PING.
	clk.Advance(DefaultRequestTimeout + 15*time.Second)
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}}); err != nil {
		t.Fatal(err)
	}
	_ = s.CloseRequest()
	if _, err := s.Receive(); !errors.Is(err, io.EOF) {
		t.Errorf("after the daemon closed, Receive = %v, want EOF", err)
	}
}
