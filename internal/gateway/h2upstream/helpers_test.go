package h2upstream

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// grpcPeer is net/http's HTTP/2 server over TLS with gRPC-ish handlers:
//
//	/echo    answers each message with itself, then grpc-status 0
//	/status  answers the first message with itself, then grpc-status 3
//	/fail    answers trailers-only grpc-status 5
//	/teapot  answers HTTP 503
//	/sink    sends headers and never reads the body
//	/hold    sends headers and waits for the client's end
//	/headers answers one message naming the request's method and headers
//	/abort   resets the stream after its headers
//	/compressed sends a message flagged compressed
func grpcPeer(t testing.TB, maxStreams uint32) *httptest.Server {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(grpcHandler))
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = &http.HTTP2Config{MaxConcurrentStreams: int(maxStreams), MaxReceiveBufferPerStream: 64 << 10, MaxReadFrameSize: 16 << 10}
	srv.Config.ErrorLog = nil
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv
}

func grpcHandler(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/grpc")
	switch r.URL.Path {
	case "/fail":
		w.Header().Set("Grpc-Status", "5")
		w.Header().Set("Grpc-Message", "no such thing")
		w.WriteHeader(http.StatusOK)
		return
	case "/teapot":
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.Header().Set("Trailer", "Grpc-Status, Grpc-Message")
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
	switch r.URL.Path {
	case "/sink":
		<-r.Context().Done()
		return
	case "/hold":
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Grpc-Status", "0")
		return
	case "/headers":
		_, _ = w.Write(frameMessage([]byte(r.Method + " " + r.Header.Get("Content-Type") + " " +
			r.Header.Get("Te") + " " + r.Header.Get("Bc-Peer-Certificate"))))
		w.Header().Set("Grpc-Status", "0")
		return
	case "/compressed":
		_, _ = w.Write([]byte{1, 0, 0, 0, 1, 'x'})
		w.(http.Flusher).Flush()
		<-r.Context().Done()
		return
	case "/abort":
		panic(http.ErrAbortHandler) // RST_STREAM
	}
	for {
		msg, err := readMessage(r.Body)
		if err != nil {
			break
		}
		_, _ = w.Write(frameMessage(msg))
		w.(http.Flusher).Flush()
		if r.URL.Path == "/status" {
			w.Header().Set("Grpc-Status", "3")
			w.Header().Set("Grpc-Message", "bad%20argument")
			return
		}
	}
	w.Header().Set("Grpc-Status", "0")
}

func readMessage(r io.Reader) ([]byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
	_, err := io.ReadFull(r, msg)
	return msg, err
}

func frameMessage(msg []byte) []byte {
	b := append([]byte{0}, binary.BigEndian.AppendUint32(nil, uint32(len(msg)))...)
	return append(b, msg...)
}

func peerTLS(srv *httptest.Server) *tls.Config {
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	return &tls.Config{RootCAs: pool}
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

func newClient(t testing.TB, cfg Config) *Client {
	t.Helper()
	if cfg.Log == nil {
		cfg.Log = quiet()
	}
	cl, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// recorder is a Handler that records a stream's events and returns its
// window at once.
type recorder struct {
	mu      sync.Mutex
	headers http.Header
	msgs    [][]byte
	sent    int
	st      *Status
	err     error
	done    chan struct{}
	got     chan []byte // each message, when not nil
	hold    bool        // keep the window (do not call Consumed)
}

func newRecorder() *recorder { return &recorder{done: make(chan struct{})} }

func (r *recorder) OnHeaders(s *Stream, h http.Header) {
	r.mu.Lock()
	r.headers = h
	r.mu.Unlock()
}

func (r *recorder) OnMessage(s *Stream, msg []byte, window int) {
	m := bytes.Clone(msg)
	r.mu.Lock()
	r.msgs = append(r.msgs, m)
	r.mu.Unlock()
	if r.got != nil {
		r.got <- m
	}
	if !r.hold {
		s.Consumed(window)
	}
}

func (r *recorder) OnSent(s *Stream, n int) {
	r.mu.Lock()
	r.sent += n
	r.mu.Unlock()
}

func (r *recorder) OnTrailers(s *Stream, st Status) {
	r.mu.Lock()
	r.st = &st
	r.mu.Unlock()
	close(r.done)
}

func (r *recorder) OnReset(s *Stream, err error) {
	r.mu.Lock()
	r.err = err
	r.mu.Unlock()
	close(r.done)
}

// end waits for the stream's end.
func (r *recorder) end(t testing.TB) (*Status, error) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the stream did not end")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.st, r.err
}

func (r *recorder) ended() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// pausable wraps a net.Conn; while paused its reads block.
type pausable struct {
	net.Conn
	mu     sync.Mutex
	paused bool
	resume chan struct{}
}

func (p *pausable) pause() {
	p.mu.Lock()
	p.paused, p.resume = true, make(chan struct{})
	p.mu.Unlock()
}

func (p *pausable) Read(b []byte) (int, error) {
	p.mu.Lock()
	paused, resume := p.paused, p.resume
	p.mu.Unlock()
	if paused {
		<-resume
		return 0, net.ErrClosed
	}
	return p.Conn.Read(b)
}

func (p *pausable) Close() error {
	p.mu.Lock()
	if p.paused {
		p.paused = false
		close(p.resume)
	}
	p.mu.Unlock()
	return p.Conn.Close()
}

func isErr(err, target error) bool { return errors.Is(err, target) }

var bg = context.Background()
