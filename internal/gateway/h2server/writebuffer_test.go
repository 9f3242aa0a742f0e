package h2server

import (
	"bytes"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// pipeHandler hands each stream to the test and counts what Sent
// reported.
type pipeHandler struct {
	streams chan *Stream
	sent    atomic.Int64
	closed  chan error
}

func newPipeHandler() *pipeHandler {
	return &pipeHandler{streams: make(chan *Stream, 1), closed: make(chan error, 1)}
}

func (h *pipeHandler) ServeStream(s *Stream) StreamHandler {
	h.streams <- s
	return h
}

func (h *pipeHandler) Data(*Stream, []byte, bool)  {}
func (h *pipeHandler) Sent(_ *Stream, n int)       { h.sent.Add(int64(n)) }
func (h *pipeHandler) Closed(_ *Stream, err error) { h.closed <- err }

// serveUnread serves one connection over net.Pipe whose client does the
// HTTP/2 handshake, opens its windows wide and one stream, and never
// reads: nothing the server writes ever leaves. It returns the stream.
func serveUnread(t *testing.T, cfg Config) (*Server, *Stream) {
	t.Helper()
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	client, server := net.Pipe()
	var wg sync.WaitGroup
	wg.Go(func() { srv.ServeConn(server) })
	t.Cleanup(func() {
		client.Close()
		srv.Close()
		wg.Wait()
	})
	var b bytes.Buffer
	b.WriteString(http2.ClientPreface)
	fr := http2.NewFramer(&b, nil)
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	_ = fr.WriteWindowUpdate(0, 1<<30)
	rc := &rawClient{t: t}
	rc.henc = hpack.NewEncoder((*sliceWriter)(&rc.hbuf))
	_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: rc.headers(), EndHeaders: true})
	// The server reads it all (a pipe's write returns once read).
	if _, err := client.Write(b.Bytes()); err != nil {
		t.Fatal(err)
	}
	return srv, <-cfg.Handler.(*pipeHandler).streams
}

// TestWriteDoesNotWaitForTheNetwork: a client that opened its windows but
// never reads its socket does not hold a Stream's writer. Writes return
// at once; what they queued stays bounded (the connection's write buffer,
// then the stream's queue, then ErrQueueFull), and Sent reports nothing,
// since no byte reached the client.
func TestWriteDoesNotWaitForTheNetwork(t *testing.T) {
	const queued, buffer = 64 << 10, 32 << 10
	h := newPipeHandler()
	_, s := serveUnread(t, Config{Handler: h, Clock: clock.NewFake(t0), WriteTimeout: time.Hour, PingInterval: time.Hour,
		MaxQueuedBytes: queued, MaxWriteBuffer: buffer})
	accepted := 0
	var last error
	done := make(chan struct{})
	go func() {
		defer close(done)
		if last = s.WriteHeaders(200, nil, false); last != nil {
			return
		}
		chunk := make([]byte, 16<<10)
		for range 100 { // 1.6 MB: far more than the bounds
			if last = s.Write(chunk); last != nil {
				return
			}
			accepted += len(chunk)
		}
	}()
	poll.Until(t, 10*time.Second, "the writes returned", func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	})
	if !errors.Is(last, ErrQueueFull) {
		t.Fatalf("the last Write: %v, want ErrQueueFull", last)
	}
	if max := buffer + maxFrameSize + queued; accepted > max {
		t.Fatalf("Write took %d bytes to a client that reads nothing, want at most %d (buffer, a frame, the queue)", accepted, max)
	}
	if q := s.Queued(); q == 0 || q > queued {
		t.Fatalf("Queued %d, want the bytes past the write buffer, at most MaxQueuedBytes (%d)", q, queued)
	}
	// A pipe's write returns once read, and the client reads nothing.
	if n := h.sent.Load(); n != 0 {
		t.Fatalf("Sent reported %d bytes that never reached the client", n)
	}
}

// TestUnreadConnectionClosedAfterWriteTimeout: a write that does not
// complete within WriteTimeout closes the connection; its streams end.
// WriteTimeout is a socket deadline (the kernel's clock), so the test
// waits for the end in real time.
func TestUnreadConnectionClosedAfterWriteTimeout(t *testing.T) {
	h := newPipeHandler()
	_, s := serveUnread(t, Config{Handler: h, Clock: clock.NewFake(t0), WriteTimeout: 50 * time.Millisecond, PingInterval: time.Hour})
	_ = s.WriteHeaders(200, nil, false)
	_ = s.Write(make([]byte, 1<<10))
	select {
	case err := <-h.closed:
		if !errors.Is(err, errConnClosed) {
			t.Fatalf("the stream ended with %v, want the connection's end", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was not closed after its write timed out")
	}
}

// TestIdleConnectionHasNoFlusher: once what was written is out, the
// connection's flusher ends and its write buffer goes back to the pool;
// the next write starts a flusher again.
func TestIdleConnectionHasNoFlusher(t *testing.T) {
	srv, addr := start(t, Config{Handler: newHold(), Clock: clock.NewFake(t0)})
	c := dialRaw(t, addr)
	idle := func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for sc := range srv.conns {
			sc.mu.Lock()
			quiet := !sc.flushing && sc.out == nil && sc.buffered == 0
			sc.mu.Unlock()
			if !quiet {
				return false
			}
		}
		return len(srv.conns) == 1
	}
	for i := range 3 {
		if err := c.open(uint32(2*i+1), false); err != nil {
			t.Fatal(err)
		}
		if err := c.do(func(fr *http2.Framer) error { return fr.WriteData(uint32(2*i+1), false, []byte("ping")) }); err != nil {
			t.Fatal(err)
		}
		c.until("the echo", func(f http2.Frame) bool {
			d, ok := f.(*http2.DataFrame)
			return ok && d.StreamID == uint32(2*i+1) && string(d.Data()) == "ping"
		})
		poll.Until(t, 10*time.Second, "the flusher gone and the buffer returned", idle)
	}
}

// TestClientThatSendsButDoesNotRead: a client that keeps opening streams
// (each answered) without reading its socket fills the connection's
// write buffer to MaxWriteBuffer, and then the server stops reading its
// frames: the buffer stays within its bound and a frame's answers.
func TestClientThatSendsButDoesNotRead(t *testing.T) {
	const buffer = 8 << 10
	answer := HandlerFunc(func(s *Stream) StreamHandler {
		_ = s.WriteHeaders(200, nil, true)
		return nil
	})
	srv, err := New(Config{Handler: answer, Clock: clock.NewFake(t0), WriteTimeout: time.Hour, PingInterval: time.Hour,
		MaxWriteBuffer: buffer, MaxConcurrentStreams: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	client, server := net.Pipe()
	var wg sync.WaitGroup
	wg.Go(func() { srv.ServeConn(server) })
	defer func() {
		client.Close()
		srv.Close()
		wg.Wait()
	}()
	wg.Go(func() {
		var b bytes.Buffer
		b.WriteString(http2.ClientPreface)
		fr := http2.NewFramer(&b, nil)
		_ = fr.WriteSettings()
		rc := &rawClient{t: t}
		rc.henc = hpack.NewEncoder((*sliceWriter)(&rc.hbuf))
		for id := uint32(1); id < 20000; id += 2 { // a few hundred KB of answers
			_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: rc.headers(), EndHeaders: true, EndStream: true})
		}
		_, _ = client.Write(b.Bytes()) // the server stops reading: ends with the test
	})
	var sc *conn
	poll.Until(t, 10*time.Second, "the server's reader waiting for room", func() bool {
		srv.mu.Lock()
		defer srv.mu.Unlock()
		for c := range srv.conns {
			sc = c
		}
		if sc == nil {
			return false
		}
		sc.mu.Lock()
		defer sc.mu.Unlock()
		return sc.readPaused
	})
	sc.mu.Lock()
	buffered := sc.buffered
	sc.mu.Unlock()
	if buffered > buffer+1<<10 {
		t.Fatalf("%d bytes buffered for a client that reads nothing, want at most MaxWriteBuffer (%d) and one frame's answers", buffered, buffer)
	}
}
