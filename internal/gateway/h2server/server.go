// Package h2server is an HTTP/2 server for the gateway's daemon side,
// built on golang.org/x/net/http2's Framer and hpack, for holding many
// idle connections cheaply: one goroutine per connection (it reads
// frames), a frame reader taken from a pool for each frame, and an HPACK
// encoder with no dynamic table. Writes never wait for the network: any
// goroutine encodes frames under a per-connection lock into the
// connection's write buffer (taken from a pool, bounded by
// MaxWriteBuffer), and a flusher goroutine, started when there is
// something to write and none runs, writes it out and ends once it is
// empty. An idle connection with one open stream holds no buffer of this
// package's own and no second goroutine: its reader, its TLS connection,
// its HPACK decoder and a few small structs.
//
// A stream is served one of two ways (Handler):
//
//   - HTTP runs an http.Handler on a goroutine per stream, while it runs
//     (unary calls: the request's headers and body in, headers, data and
//     trailers out);
//   - a StreamHandler receives a stream's events as callbacks on the
//     connection's goroutine and writes with the Stream's methods from any
//     goroutine, so a long-lived stream (a relayed gRPC session) costs no
//     goroutine while it is idle. Flow control is the handler's to pace:
//     it returns receive window with Stream.Consumed once it has passed
//     the bytes on, and learns from StreamHandler.Sent when what it queued
//     has left.
//
// Hostile clients are bounded: streams beyond MaxConcurrentStreams are
// refused (RST_STREAM REFUSED_STREAM); resets, PINGs, SETTINGS, PRIORITY
// and empty frames beyond ControlFramesPerSecond end the connection with
// GOAWAY ENHANCE_YOUR_CALM (rapid reset, CVE-2023-44487); a header block
// (CONTINUATION frames included) is bounded by MaxHeaderListSize; the TLS
// handshake, the client preface and the first SETTINGS must finish within
// HandshakeTimeout; a stream whose client does not read keeps at most its
// send window plus what its handler queued (MaxQueuedBytes) and is reset
// after StreamStallTimeout without progress; a connection whose client
// stops reading its socket holds at most MaxWriteBuffer (and a few
// control frames) encoded, stops being read past it, and is closed once a
// write has waited WriteTimeout, which holds its flusher and nothing
// else; a connection without streams
// is closed after IdleTimeout; one that stops answering PINGs is closed
// after PingInterval and PingTimeout.
//
// Timers run on the injected clock; network writes have a real-time
// deadline (WriteTimeout), the kernel's business.
package h2server

import (
	"context"
	"crypto/tls"
	"errors"
	"log"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Defaults for Config.
const (
	DefaultHandshakeTimeout       = 10 * time.Second
	DefaultIdleTimeout            = 120 * time.Second
	DefaultStreamStallTimeout     = 120 * time.Second
	DefaultWriteTimeout           = 20 * time.Second
	DefaultPingInterval           = 60 * time.Second
	DefaultPingTimeout            = 20 * time.Second
	DefaultMaxConcurrentStreams   = 8
	DefaultInitialWindowSize      = 64<<10 + 5 + 1024 // max_body_bytes, a gRPC envelope and some
	DefaultMaxHeaderListSize      = 32 << 10
	DefaultControlFramesPerSecond = 100
	DefaultMaxQueuedBytes         = 256 << 10
	DefaultMaxWriteBuffer         = 64 << 10
	// maxFrameSize is what the server reads and writes: the HTTP/2 minimum.
	maxFrameSize = 16 << 10
)

// ErrServerClosed is returned by Serve after Shutdown or Close.
var ErrServerClosed = errors.New("h2server: server closed")

// Config configures a Server. Zero values take the defaults.
type Config struct {
	// Handler serves the streams (required).
	Handler Handler
	// TLS, when set, makes the server terminate TLS on each accepted
	// connection; the client must negotiate "h2" (ALPN) unless Other is
	// set. Nil: the connections speak HTTP/2 in the clear with prior
	// knowledge (tests, h2spec).
	TLS *tls.Config
	// Other, when set, receives a TLS connection that negotiated another
	// protocol than "h2" (HTTP/1.1), after its handshake. It owns it.
	Other func(*tls.Conn)
	Clock clock.Clock
	Log   *slog.Logger
	// ErrorLog, when set, gets a line for each failed TLS handshake, in
	// net/http's words ("http: TLS handshake error from PEER: ERR"), so
	// one rate-limited writer serves both servers (http.Server.ErrorLog).
	ErrorLog *log.Logger
	// HandshakeTimeout bounds the TLS handshake, the client preface and
	// the client's first SETTINGS together.
	HandshakeTimeout time.Duration
	// IdleTimeout closes a connection without any stream for this long.
	IdleTimeout time.Duration
	// StreamStallTimeout resets a stream whose queued data made no
	// progress (the client does not read) for this long.
	StreamStallTimeout time.Duration
	// WriteTimeout bounds one write of the connection's flusher to the
	// network; past it the connection is closed.
	WriteTimeout time.Duration
	// PingInterval: after this long without a frame from the client, the
	// server sends a PING; without its ACK within PingTimeout the
	// connection is closed (a client that vanished without closing it).
	PingInterval time.Duration
	PingTimeout  time.Duration
	// MaxConcurrentStreams is advertised and enforced per connection.
	MaxConcurrentStreams uint32
	// InitialWindowSize is each stream's receive window.
	InitialWindowSize uint32
	// MaxHeaderListSize bounds a request's header block, decoded.
	MaxHeaderListSize uint32
	// ControlFramesPerSecond is the per-connection budget of RST_STREAM,
	// PING, SETTINGS, PRIORITY and empty DATA frames, and of the streams
	// the server refuses or resets for a frame the client sent.
	ControlFramesPerSecond int
	// MaxQueuedBytes bounds what a stream's handler can queue beyond the
	// client's window (Stream.Write returns ErrQueueFull past it).
	MaxQueuedBytes int
	// MaxWriteBuffer bounds what a connection has encoded and not yet
	// written: past it, streams' DATA waits in their queues (and counts
	// against MaxQueuedBytes) and the connection's frames are not read
	// until its flusher has written some out.
	MaxWriteBuffer int
	// ReadTimeout, under HTTP, bounds the time from a request's headers
	// to the end of its body, as net/http's Server.ReadTimeout does per
	// stream: past it the stream is reset (CANCEL) and the handler's body
	// read fails with an error wrapping os.ErrDeadlineExceeded. A handler
	// moves or lifts it with http.ResponseController.SetReadDeadline.
	// Zero: no deadline.
	ReadTimeout time.Duration
}

func (c *Config) defaults() error {
	if c.Handler == nil {
		return errors.New("h2server: Config.Handler is required")
	}
	if c.Clock == nil {
		c.Clock = clock.Real{}
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.HandshakeTimeout, DefaultHandshakeTimeout)
	def(&c.IdleTimeout, DefaultIdleTimeout)
	def(&c.StreamStallTimeout, DefaultStreamStallTimeout)
	def(&c.WriteTimeout, DefaultWriteTimeout)
	def(&c.PingInterval, DefaultPingInterval)
	def(&c.PingTimeout, DefaultPingTimeout)
	if c.MaxConcurrentStreams == 0 {
		c.MaxConcurrentStreams = DefaultMaxConcurrentStreams
	}
	if c.InitialWindowSize == 0 {
		c.InitialWindowSize = DefaultInitialWindowSize
	}
	if c.InitialWindowSize > 1<<31-1 {
		return errors.New("h2server: InitialWindowSize over 2^31-1")
	}
	if c.MaxHeaderListSize == 0 {
		c.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	if c.ControlFramesPerSecond <= 0 {
		c.ControlFramesPerSecond = DefaultControlFramesPerSecond
	}
	if c.MaxQueuedBytes <= 0 {
		c.MaxQueuedBytes = DefaultMaxQueuedBytes
	}
	if c.MaxWriteBuffer <= 0 {
		c.MaxWriteBuffer = DefaultMaxWriteBuffer
	}
	return nil
}

// Server serves HTTP/2 connections. Build it with New.
type Server struct {
	cfg Config
	// wg counts the accept loops, the connections and the handlers'
	// goroutines (Stream.Go): Shutdown and Close wait for all of them.
	wg sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	draining bool
	lns      map[net.Listener]struct{}
	conns    map[*conn]struct{}
	// gone is closed when the last connection ends after draining starts.
	gone chan struct{}
	// stopCtx ends with Shutdown or Close (an accept loop's backoff).
	stopCtx context.Context
	stop    context.CancelFunc
}

// New checks cfg and builds a Server.
func New(cfg Config) (*Server, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, lns: map[net.Listener]struct{}{}, conns: map[*conn]struct{}{}, gone: make(chan struct{})}
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	return s, nil
}

// acceptBackoff spaces out retries after a failed Accept (out of
// descriptors, say).
var acceptBackoff = backoff.Policy{Min: 5 * time.Millisecond, Max: time.Second}

// Serve accepts connections on ln and serves each on its own goroutine
// until Shutdown or Close; it then returns ErrServerClosed.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed || s.draining {
		s.mu.Unlock()
		ln.Close()
		return ErrServerClosed
	}
	s.lns[ln] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	fails := 0
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.stopping() {
				return ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			fails++
			s.cfg.Log.Warn("h2server: accept failed; retrying", "err", err)
			if acceptBackoff.Wait(s.stopCtx, s.cfg.Clock, fails) != nil {
				return ErrServerClosed
			}
			continue
		}
		fails = 0
		if !s.track() {
			nc.Close()
			return ErrServerClosed
		}
		go func() {
			defer s.wg.Done()
			s.serve(nc)
		}()
	}
}

// ServeConn serves one accepted connection and returns when it ends.
func (s *Server) ServeConn(nc net.Conn) {
	if !s.track() {
		nc.Close()
		return
	}
	defer s.wg.Done()
	s.serve(nc)
}

// track adds one to wg unless the server stopped.
func (s *Server) track() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.draining {
		return false
	}
	s.wg.Add(1)
	return true
}

func (s *Server) stopping() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed || s.draining
}

func (s *Server) serve(nc net.Conn) {
	c := newConn(s, nc)
	s.mu.Lock()
	if s.closed || s.draining {
		s.mu.Unlock()
		nc.Close()
		return
	}
	s.conns[c] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		if (s.closed || s.draining) && len(s.conns) == 0 {
			select {
			case <-s.gone:
			default:
				close(s.gone)
			}
		}
		s.mu.Unlock()
	}()
	c.serve()
}

// Shutdown stops accepting, sends every connection GOAWAY with the last
// stream it took, closes those without streams, and waits for the others'
// streams to end until ctx ends; then it closes what is left and waits
// for every goroutine of the server. It returns ctx's error if the grace
// ran out.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	conns := s.closeListenersLocked()
	empty := len(s.conns) == 0
	s.mu.Unlock()
	for _, c := range conns {
		c.goAway()
	}
	var err error
	if !empty {
		select {
		case <-s.gone:
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	s.Close()
	return err
}

// Close closes the listeners and every connection at once, then waits
// for the server's goroutines.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	conns := s.closeListenersLocked()
	s.mu.Unlock()
	for _, c := range conns {
		// raw, not nc: the handshake replaces nc under c.mu, and closing
		// the socket ends a TLS connection on it too.
		c.raw.Close()
	}
	s.wg.Wait()
	return nil
}

func (s *Server) closeListenersLocked() []*conn {
	s.stop()
	for ln := range s.lns {
		ln.Close()
		delete(s.lns, ln)
	}
	conns := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	return conns
}
