package h2upstream

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Streams of every kind, with the default buffers and with a small read
// buffer and no HPACK table (a load generator's many connections): a
// message larger than the buffer, and headers the server would index,
// arrive whole.
func TestStreams(t *testing.T) {
	srv := grpcPeer(t, 100)
	for _, c := range []Config{{}, {ReadBufferSize: 64, HeaderTableSize: 1}} {
		c.Addr, c.TLS, c.Conns = srv.Listener.Addr().String(), peerTLS(srv), 1
		t.Run(fmt.Sprintf("buffer=%d,table=%d", c.ReadBufferSize, c.HeaderTableSize), func(t *testing.T) {
			testStreams(t, newClient(t, c))
		})
	}
}

func testStreams(t *testing.T, cl *Client) {
	large := string(bytes.Repeat([]byte("x"), 20000))
	tests := []struct {
		name, path string
		send       []string
		wantMsgs   []string
		wantCode   int
		wantMsg    string
	}{
		{"unary", "/echo", []string{"hello"}, []string{"hello"}, 0, ""},
		{"bidi", "/echo", []string{"a", "", "ccc"}, []string{"a", "", "ccc"}, 0, ""},
		{"status in trailers", "/status", []string{"x"}, []string{"x"}, 3, "bad argument"},
		{"trailers only", "/fail", nil, nil, 5, "no such thing"},
		{"HTTP status", "/teapot", nil, nil, CodeUnavailable, "h2upstream: HTTP status 503"},
		{"request headers", "/headers", nil, []string{"POST application/grpc trailers pem"}, 0, ""},
		{"a large message", "/echo", []string{large, "y"}, []string{large, "y"}, 0, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newRecorder()
			s, err := cl.Open(bg, Request{Path: tc.path, Header: http.Header{"Bc-Peer-Certificate": {"pem"}}}, r)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range tc.send {
				if err := s.Send([]byte(m)); err != nil {
					t.Fatal(err)
				}
			}
			_ = s.CloseSend()
			st, err := r.end(t)
			if err != nil {
				t.Fatalf("reset: %v", err)
			}
			if st.Code != tc.wantCode || st.Message != tc.wantMsg {
				t.Errorf("status %d %q, want %d %q", st.Code, st.Message, tc.wantCode, tc.wantMsg)
			}
			var got []string
			for _, m := range r.msgs {
				got = append(got, string(m))
			}
			if fmt.Sprint(got) != fmt.Sprint(tc.wantMsgs) {
				t.Errorf("messages %q, want %q", got, tc.wantMsgs)
			}
		})
	}
}

// A stream the server resets ends with OnReset and the server's code;
// the connection goes on.
func TestServerReset(t *testing.T) {
	srv := grpcPeer(t, 100)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Conns: 1})
	r := newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/abort"}, r); err != nil {
		t.Fatal(err)
	}
	_, err := r.end(t)
	var rst StreamResetError
	if !errors.As(err, &rst) || !rst.Remote || IsRetryable(err) {
		t.Fatalf("end %v, want the server's reset", err)
	}
	r2 := newRecorder()
	s, err := cl.Open(bg, Request{Path: "/echo"}, r2)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.CloseSend()
	if st, err := r2.end(t); err != nil || st.Code != 0 {
		t.Fatalf("the next stream: %v %v", st, err)
	}
	if cl.Conns() != 1 {
		t.Errorf("%d connections, want 1", cl.Conns())
	}
}

func TestIsRetryable(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{GoAwayError{LastStreamID: 1}, true},
		{StreamResetError{Code: http2.ErrCodeRefusedStream, Remote: true}, true},
		{StreamResetError{Code: http2.ErrCodeRefusedStream}, false},
		{StreamResetError{Code: http2.ErrCodeInternal, Remote: true}, false},
		{ErrPingTimeout, false},
		{fmt.Errorf("wrapped: %w", GoAwayError{}), true},
	} {
		if got := IsRetryable(tc.err); got != tc.want {
			t.Errorf("IsRetryable(%v) = %v", tc.err, got)
		}
	}
}

// Many streams share one connection, interleaved.
func TestManyStreamsOneConnection(t *testing.T) {
	srv := grpcPeer(t, 1000)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Conns: 1})
	const n = 200
	streams := make([]*Stream, n)
	recs := make([]*recorder, n)
	for i := range n {
		recs[i] = newRecorder()
		var err error
		if streams[i], err = cl.Open(bg, Request{Path: "/echo"}, recs[i]); err != nil {
			t.Fatal(err)
		}
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			for j := range 3 {
				_ = streams[i].Send(fmt.Appendf(nil, "%d-%d", i, j))
			}
			_ = streams[i].CloseSend()
		})
	}
	wg.Wait()
	for i, r := range recs {
		if st, err := r.end(t); err != nil || st.Code != 0 || len(r.msgs) != 3 || string(r.msgs[2]) != fmt.Sprintf("%d-2", i) {
			t.Fatalf("stream %d: %v %v %q", i, st, err, r.msgs)
		}
	}
	if got := cl.Conns(); got != 1 {
		t.Errorf("%d connections, want 1", got)
	}
}

// Streams spread over Conns connections, and one more opens when all
// are at the server's MAX_CONCURRENT_STREAMS.
func TestSpreadAndMaxConcurrentStreams(t *testing.T) {
	srv := grpcPeer(t, 3)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Conns: 2})
	var streams []*Stream
	for i := range 7 {
		s, err := cl.Open(bg, Request{Path: "/hold"}, newRecorder())
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
		if i == 1 && cl.Conns() != 2 {
			t.Fatalf("after 2 streams, %d connections, want 2", cl.Conns())
		}
	}
	if got := cl.Conns(); got != 3 {
		t.Errorf("7 streams at 3 per connection: %d connections, want 3", got)
	}
	for _, s := range streams {
		_ = s.CloseSend()
	}
}

// Callers opening at once while the connections are dialed share them:
// no more than Conns are made.
func TestConcurrentOpensShareDials(t *testing.T) {
	srv := grpcPeer(t, 1000)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Conns: 2})
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Go(func() {
			if _, err := cl.Open(bg, Request{Path: "/hold"}, newRecorder()); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := cl.Conns(); got != 2 {
		t.Errorf("%d connections, want 2", got)
	}
}

// Messages larger than the windows on both sides go through.
func TestFlowControlLargeMessages(t *testing.T) {
	srv := grpcPeer(t, 100)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Conns: 1,
		MaxMessageSize: 1 << 20, InitialWindowSize: 16 << 10, MaxQueuedBytes: 4 << 20})
	r := newRecorder()
	r.got = make(chan []byte, 8)
	s, err := cl.Open(bg, Request{Path: "/echo"}, r)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		msg := bytes.Repeat([]byte{byte('a' + i)}, 300<<10)
		if err := s.Send(msg); err != nil {
			t.Fatal(err)
		}
		if got := <-r.got; !bytes.Equal(got, msg) {
			t.Fatalf("message %d: %d bytes back", i, len(got))
		}
	}
	_ = s.CloseSend()
	if st, err := r.end(t); err != nil || st.Code != 0 {
		t.Fatalf("end: %v %v", st, err)
	}
	if r.sent != 4*(300<<10+5) {
		t.Errorf("OnSent reported %d bytes", r.sent)
	}
}

// A compressed message (none was offered) resets the stream.
func TestCompressedMessage(t *testing.T) {
	srv := grpcPeer(t, 100)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv)})
	r := newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/compressed"}, r); err != nil {
		t.Fatal(err)
	}
	if _, err := r.end(t); !isErr(err, ErrCompressed) || len(r.msgs) != 0 {
		t.Fatalf("end %v after %d messages, want ErrCompressed", err, len(r.msgs))
	}
}

// A message over MaxMessageSize resets the stream.
func TestMessageTooLarge(t *testing.T) {
	srv := grpcPeer(t, 100)
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), MaxMessageSize: 10})
	r := newRecorder()
	s, err := cl.Open(bg, Request{Path: "/echo"}, r)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Send(make([]byte, 11))
	if _, err := r.end(t); !isErr(err, ErrMessageTooLarge) {
		t.Fatalf("end %v, want ErrMessageTooLarge", err)
	}
}

// A server that stops reading: the queue is bounded (ErrQueueFull) and
// the stream is reset after StreamStallTimeout.
func TestServerStopsReading(t *testing.T) {
	srv := grpcPeer(t, 100)
	clk := clock.NewFake(time.Unix(1e9, 0))
	const queue = 128 << 10
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Clock: clk,
		MaxQueuedBytes: queue, StreamStallTimeout: time.Minute, PingInterval: time.Hour})
	r := newRecorder()
	s, err := cl.Open(bg, Request{Path: "/sink"}, r)
	if err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 1000)
	var full error
	poll.Until(t, 30*time.Second, "ErrQueueFull", func() bool {
		full = s.Send(msg)
		return full != nil
	})
	if !isErr(full, ErrQueueFull) {
		t.Fatalf("Send: %v", full)
	}
	if q := s.Queued(); q > queue+len(msg)+5 || q < queue/2 {
		t.Errorf("%d bytes queued, bound %d", q, queue)
	}
	poll.Until(t, 30*time.Second, "the stall reset", func() bool {
		clk.Advance(time.Minute)
		return r.ended()
	})
	if _, err := r.end(t); !isErr(err, ErrStalled) {
		t.Fatalf("end %v, want ErrStalled", err)
	}
}

// A connection whose server stops answering fails after the PING
// timeout, and so do its streams.
func TestPingTimeout(t *testing.T) {
	srv := grpcPeer(t, 100)
	clk := clock.NewFake(time.Unix(1e9, 0))
	var pc *pausable
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		pc = &pausable{Conn: c}
		return pc, nil
	}
	cl := newClient(t, Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Clock: clk, Dial: dial,
		Conns: 1, PingInterval: 10 * time.Second, PingTimeout: 5 * time.Second})
	r := newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/hold"}, r); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 30*time.Second, "the response headers", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.headers != nil
	})
	pc.pause()
	poll.Until(t, 30*time.Second, "the PING timeout", func() bool {
		clk.Advance(5 * time.Second)
		return r.ended()
	})
	if _, err := r.end(t); !isErr(err, ErrPingTimeout) {
		t.Fatalf("end %v, want ErrPingTimeout", err)
	}
	if cl.Conns() != 0 {
		t.Error("the failed connection is still offered")
	}
}

// After the server restarts, the next Open dials again (after a
// backoff when a dial failed).
func TestReconnect(t *testing.T) {
	srv := grpcPeer(t, 100)
	addr := srv.Listener.Addr().String()
	cl := newClient(t, Config{Addr: addr, TLS: peerTLS(srv), Conns: 1,
		Backoff: backoff.Policy{Min: time.Millisecond, Max: 10 * time.Millisecond}})
	r := newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/hold"}, r); err != nil {
		t.Fatal(err)
	}
	srv.CloseClientConnections()
	srv.Listener.Close()
	if _, err := r.end(t); err == nil {
		t.Fatal("the stream outlived its connection")
	}
	if _, err := cl.Open(bg, Request{Path: "/hold"}, newRecorder()); err == nil {
		t.Fatal("Open with the server down succeeded")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the port was taken meanwhile: %v", err)
	}
	srv2 := &http.Server{Handler: http.HandlerFunc(grpcHandler), HTTP2: srv.Config.HTTP2}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv2.Serve(tls.NewListener(ln, srv.TLS))
	}()
	t.Cleanup(func() {
		srv2.Close()
		<-served
	})
	r2 := newRecorder()
	s, err := cl.Open(bg, Request{Path: "/echo"}, r2)
	if err != nil {
		t.Fatal(err)
	}
	_ = s.Send([]byte("again"))
	_ = s.CloseSend()
	if st, err := r2.end(t); err != nil || st.Code != 0 || len(r2.msgs) != 1 {
		t.Fatalf("after the restart: %v %v", st, err)
	}
}

// Close ends every stream and joins every goroutine the client started.
func TestCloseJoinsEverything(t *testing.T) {
	srv := grpcPeer(t, 100)
	before := goroutines.Take()
	cl, err := New(Config{Addr: srv.Listener.Addr().String(), TLS: peerTLS(srv), Log: quiet(), PingInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var recs []*recorder
	for range 10 {
		r := newRecorder()
		if _, err := cl.Open(bg, Request{Path: "/hold"}, r); err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	cl.Close()
	for _, r := range recs {
		if _, err := r.end(t); !isErr(err, ErrClosed) {
			t.Errorf("end %v, want ErrClosed", err)
		}
	}
	if _, err := cl.Open(bg, Request{Path: "/hold"}, newRecorder()); !isErr(err, ErrClosed) {
		t.Errorf("Open after Close: %v", err)
	}
	goroutines.Joined(t, before, "internal/gateway/h2upstream")
}
