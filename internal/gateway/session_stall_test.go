package gateway

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
)

// stallSessions floods every session whose first message is not a Hello
// (the stalled daemon's) with commands of size bytes until its stream
// ends, counting them; it answers each message of the other sessions
// with a command carrying the message's command id as its signature.
type stallSessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	size    int
	flooded atomic.Int64
	// ended: the flood's stream ended (it was not held back).
	ended atomic.Bool
}

func (f *stallSessions) Connect(_ context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: fakeNonce}}}); err != nil {
		return nil
	}
	first, err := s.Receive()
	if err != nil {
		return nil
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{NodeId: "node_01"}}}); err != nil {
		return nil
	}
	if first.GetHello() == nil {
		body := bytes.Repeat([]byte{0x42}, f.size)
		for {
			if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: &agentv1.SignedCommand{Body: body}}}); err != nil {
				f.ended.Store(true)
				return nil
			}
			f.flooded.Add(1)
		}
	}
	for {
		m, err := s.Receive()
		if err != nil {
			return nil
		}
		sig := []byte(m.GetResult().GetCommandId())
		if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: &agentv1.SignedCommand{Sig: sig}}}); err != nil {
			return nil
		}
	}
}

// dialStalledDaemon opens a session on gw as a daemon with a valid
// identity that does the HTTP/2 handshake, opens its windows wide, sends
// one empty message and never reads its socket again.
func dialStalledDaemon(t *testing.T, e *env, gw string) *tls.Conn {
	t.Helper()
	nc, err := tls.Dial("tcp", gw, &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, NextProtos: []string{"h2"},
		Certificates: []tls.Certificate{e.nodeCert(t, "node_02")}})
	if err != nil {
		t.Fatal(err)
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":authority", gw},
		{":path", agentv1connect.SessionServiceConnectProcedure}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if _, err := io.WriteString(nc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(nc, nil)
	for _, err := range []error{
		fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30}),
		fr.WriteWindowUpdate(0, 1<<30),
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true}),
		fr.WriteData(1, false, make([]byte, 5)), // an empty gRPC message
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	return nc
}

// A daemon with a valid identity that opens its HTTP/2 window and stops
// reading its socket does not hold the upstream connection it shares with
// other sessions: the gateway writes to it from the connection's flusher,
// never from the upstream connection's reader, and stops returning the
// API's window for its session once its socket takes no more. Another
// session on the same upstream connection keeps exchanging messages after
// the stalled one's flood has stopped moving.
func TestSessionCallbacksStalledDaemonDoesNotHoldOthers(t *testing.T) {
	e := newEnv(t)
	sessionSide{DaemonHTTP2Framer, SessionRelayCallbacks}.apply(e)
	const size = 16 << 10
	f := &stallSessions{size: size}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewSessionServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = agentListenerHTTP2()
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	cfg := e.config(srv.URL)
	cfg.UpstreamConns = 1 // both sessions on one upstream connection
	_, gw := startGateway(t, cfg)

	stalled := dialStalledDaemon(t, e, gw)
	defer stalled.Close() // before the gateway's shutdown
	poll.Until(t, 30*time.Second, "the API flooding the stalled session", func() bool { return f.flooded.Load() >= 6 })

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, tr, err := openSession(ctx, e, gw, nil, e.nodeCert(t, "node_01"))
	defer tr.CloseIdleConnections()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.CloseResponse() }()
	// Round trips until the flood has not moved for several of them (the
	// stalled daemon's socket and the gateway's bounds are full), and a
	// few more: each must come back well within h2server's WriteTimeout
	// (20 s), which a reader held by the stalled daemon would wait out.

	still, last := 0, int64(-1)
	for i := 0; still < 20; i++ {
		id := strconv.Itoa(i)
		if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: &agentv1.CommandResult{CommandId: id}}}); err != nil {
			t.Fatalf("round %d: send: %v", i, err)
		}
		got := make(chan error, 1)
		go func() {
			m, err := s.Receive()
			if err == nil && string(m.GetCommand().GetSig()) != id {
				err = io.ErrUnexpectedEOF
			}
			got <- err
		}()
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("round %d (the flood at %d messages): %v", i, f.flooded.Load(), err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: no answer within 10 s while the stalled daemon's flood is at %d messages", i, f.flooded.Load())
		}
		if n := f.flooded.Load(); n == last {
			still++
		} else {
			still, last = 0, n
		}
	}
	if f.ended.Load() {
		t.Fatal("the stalled daemon's session ended; want it held back by flow control")
	}
}
