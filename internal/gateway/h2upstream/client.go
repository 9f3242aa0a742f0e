// Package h2upstream is an HTTP/2 client for the gateway's upstream side
// (gateway to API), built on golang.org/x/net/http2's Framer and hpack,
// for holding many long-lived gRPC bidi streams cheaply: they are
// multiplexed onto a few TLS connections per upstream (Config.Conns,
// streams spread over them, one more connection when all are at the
// server's MAX_CONCURRENT_STREAMS). Each connection has one goroutine,
// which reads frames and hands them to the streams' callbacks. Writes
// never wait for the network: the caller's goroutine encodes frames under
// a per-connection lock (with an HPACK encoder that never indexes) into
// the connection's write buffer, taken from a pool and bounded by
// MaxWriteBuffer, and a flusher goroutine, started when there is
// something to write and none runs, writes it out within WriteTimeout and
// ends once it is empty. An idle open stream is a struct: no goroutine,
// no buffer.
//
// It is the symmetric half of h2server's StreamHandler: a relay feeds a
// daemon stream's messages to Stream.Send and returns the daemon's window
// with h2server's Stream.Consumed when Handler.OnSent says they left;
// Handler.OnMessage's bytes go to the daemon stream's Write, and
// Stream.Consumed returns them to the API once the daemon's Sent says so.
//
// Flow control: the server's windows are respected; what exceeds them is
// queued per stream, up to MaxQueuedBytes (Send returns ErrQueueFull past
// it), and a stream whose queue makes no progress for StreamStallTimeout
// (a server that stops reading) is reset. Each stream's receive window is
// InitialWindowSize, returned as the handler calls Consumed.
//
// A connection that answers no PING within PingTimeout fails, and so do
// its streams. On GOAWAY, streams the server did not take fail with an
// error IsRetryable reports, and new streams go to another connection.
// Failed dials are retried at the next Open after a backoff.
//
// Timers run on the injected clock; network writes and the handshake
// have real-time deadlines, the kernel's business.
package h2upstream

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Defaults for Config.
const (
	DefaultConns              = 4
	DefaultHandshakeTimeout   = 10 * time.Second
	DefaultWriteTimeout       = 20 * time.Second
	DefaultPingInterval       = 30 * time.Second
	DefaultPingTimeout        = 15 * time.Second
	DefaultStreamStallTimeout = 120 * time.Second
	DefaultMaxMessageSize     = 64 << 10
	DefaultInitialWindowSize  = 64<<10 + 5 + 1024 // a message, its envelope and some
	DefaultMaxQueuedBytes     = 256 << 10
	DefaultMaxWriteBuffer     = 64 << 10
	DefaultMaxHeaderListSize  = 32 << 10
	DefaultReadBufferSize     = 4 << 10
	DefaultHeaderTableSize    = 4096
	// connWindow is the connection's receive window: the streams' windows
	// bound what is buffered, so it is only a counter.
	connWindow   = 1 << 30
	maxFrameSize = 16 << 10
)

// DefaultBackoff spaces the dials after a failed one.
var DefaultBackoff = backoff.Policy{Min: 100 * time.Millisecond, Max: 10 * time.Second, Jitter: backoff.DefaultJitter}

// Errors of the client and its streams.
var (
	ErrClosed      = errors.New("h2upstream: client closed")
	ErrConnClosed  = errors.New("h2upstream: connection closed")
	ErrPingTimeout = errors.New("h2upstream: connection answered no PING")
	ErrStalled     = errors.New("h2upstream: stream's queued data made no progress")
	ErrQueueFull   = errors.New("h2upstream: stream's write queue full")
	ErrStreamEnded = errors.New("h2upstream: stream ended")
	ErrSendClosed  = errors.New("h2upstream: stream's send side closed")
	// ErrCompressed ends a stream whose server sent a compressed message:
	// the client offers no compression.
	ErrCompressed = errors.New("h2upstream: compressed gRPC message")
)

// GoAwayError fails a stream the server did not take before its GOAWAY:
// it was not processed, and may be opened again (IsRetryable).
type GoAwayError struct {
	Code         http2.ErrCode
	LastStreamID uint32
}

func (e GoAwayError) Error() string {
	return fmt.Sprintf("h2upstream: server sent GOAWAY (%v, last stream %d)", e.Code, e.LastStreamID)
}

// StreamResetError is a stream's end by RST_STREAM.
type StreamResetError struct {
	Code   http2.ErrCode
	Remote bool // the server reset it
}

func (e StreamResetError) Error() string {
	who := "client"
	if e.Remote {
		who = "server"
	}
	return fmt.Sprintf("h2upstream: stream reset by the %s: %v", who, e.Code)
}

// IsRetryable reports whether err ended a stream the server did not
// process (GOAWAY past it, REFUSED_STREAM): it may be opened again.
func IsRetryable(err error) bool {
	var g GoAwayError
	var r StreamResetError
	return errors.As(err, &g) || errors.As(err, &r) && r.Remote && r.Code == http2.ErrCodeRefusedStream
}

// Config configures a Client. Zero values take the defaults.
type Config struct {
	// Addr is the upstream's host:port (required).
	Addr string
	// TLS is the client's TLS configuration; "h2" is negotiated. Nil:
	// HTTP/2 in the clear with prior knowledge (tests).
	TLS *tls.Config
	// Dial makes the network connection (default: net.Dialer).
	Dial  func(ctx context.Context, network, addr string) (net.Conn, error)
	Clock clock.Clock
	Log   *slog.Logger
	// Conns is how many connections streams are spread over.
	Conns int
	// HandshakeTimeout bounds the dial, the TLS handshake and the
	// server's first SETTINGS.
	HandshakeTimeout time.Duration
	// WriteTimeout bounds one write of a connection's flusher to the
	// network; past it the connection fails.
	WriteTimeout time.Duration
	// PingInterval: after this long without a frame from the server, the
	// client sends a PING; without its ACK within PingTimeout the
	// connection fails.
	PingInterval, PingTimeout time.Duration
	// StreamStallTimeout resets a stream whose queued data made no
	// progress (the server does not read) for this long.
	StreamStallTimeout time.Duration
	// MaxMessageSize bounds one received gRPC message.
	MaxMessageSize int
	// InitialWindowSize is each stream's receive window.
	InitialWindowSize uint32
	// MaxQueuedBytes bounds what a stream queues beyond the server's
	// window.
	MaxQueuedBytes int
	// MaxWriteBuffer bounds what a connection has encoded and not yet
	// written: past it, streams' DATA waits in their queues (and counts
	// against MaxQueuedBytes).
	MaxWriteBuffer int
	// MaxHeaderListSize bounds a response's header block, decoded.
	MaxHeaderListSize uint32
	// Backoff spaces dials after a failed one.
	Backoff backoff.Policy
	// ReadBufferSize is each connection's read buffer (frames are read
	// through it). A client of many connections that each carry little,
	// a load generator's, takes a small one.
	ReadBufferSize int
	// HeaderTableSize is the HPACK dynamic table the client decodes the
	// server's headers with, advertised in SETTINGS_HEADER_TABLE_SIZE
	// (0: DefaultHeaderTableSize). A connection that carries a stream or
	// two indexes next to nothing: 1 keeps no entry (none fits) and
	// tells the server not to keep one either.
	HeaderTableSize uint32
}

func (c *Config) defaults() error {
	if c.Addr == "" {
		return errors.New("h2upstream: Config.Addr is required")
	}
	if c.Clock == nil {
		c.Clock = clock.Real{}
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.Dial == nil {
		var d net.Dialer
		c.Dial = d.DialContext
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.HandshakeTimeout, DefaultHandshakeTimeout)
	def(&c.WriteTimeout, DefaultWriteTimeout)
	def(&c.PingInterval, DefaultPingInterval)
	def(&c.PingTimeout, DefaultPingTimeout)
	def(&c.StreamStallTimeout, DefaultStreamStallTimeout)
	if c.Conns <= 0 {
		c.Conns = DefaultConns
	}
	if c.MaxMessageSize <= 0 {
		c.MaxMessageSize = DefaultMaxMessageSize
	}
	if c.InitialWindowSize == 0 {
		c.InitialWindowSize = DefaultInitialWindowSize
	}
	if c.InitialWindowSize > 1<<31-1 {
		return errors.New("h2upstream: InitialWindowSize over 2^31-1")
	}
	if c.MaxQueuedBytes <= 0 {
		c.MaxQueuedBytes = DefaultMaxQueuedBytes
	}
	if c.MaxWriteBuffer <= 0 {
		c.MaxWriteBuffer = DefaultMaxWriteBuffer
	}
	if c.MaxHeaderListSize == 0 {
		c.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	if c.ReadBufferSize <= 0 {
		c.ReadBufferSize = DefaultReadBufferSize
	}
	if c.HeaderTableSize == 0 {
		c.HeaderTableSize = DefaultHeaderTableSize
	}
	if c.Backoff == (backoff.Policy{}) {
		c.Backoff = DefaultBackoff
	}
	return nil
}

// Client holds the connections to one upstream. Build it with New.
type Client struct {
	cfg Config
	// wg counts the connections' goroutines and timer callbacks in
	// flight: Close waits for them.
	wg sync.WaitGroup
	// dialing is a one-slot semaphore: one dial at a time.
	dialing chan struct{}

	mu     sync.Mutex
	closed bool
	conns  []*conn
	next   int
	fails  int // dials failed in a row
}

// New checks cfg and builds a Client. It dials nothing until Open.
func New(cfg Config) (*Client, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	return &Client{cfg: cfg, dialing: make(chan struct{}, 1)}, nil
}

// Open opens a stream with req's headers on a connection with room,
// dialing one if needed; h receives its events. It waits for no answer.
// A stream whose HEADERS could not be written is returned ended (its
// OnReset called).
func (cl *Client) Open(ctx context.Context, req Request, h Handler) (*Stream, error) {
	for {
		if s, err := cl.tryOpen(req, h, false); s != nil || err != nil {
			return s, err
		}
		select {
		case cl.dialing <- struct{}{}:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		// Another caller may have dialed while this one waited.
		s, err := cl.tryOpen(req, h, false)
		if s == nil && err == nil {
			if err = cl.dial(ctx); err == nil {
				s, err = cl.tryOpen(req, h, true)
			}
		}
		<-cl.dialing
		if s != nil || err != nil {
			return s, err
		}
	}
}

// tryOpen opens the stream on an existing connection with room, round
// robin. Before Conns connections are up it opens none (a new one is
// dialed) unless any is true.
func (cl *Client) tryOpen(req Request, h Handler, any bool) (*Stream, error) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.closed {
		return nil, ErrClosed
	}
	// Closed connections leave the list; those going away stay (Close
	// ends them) but take no new stream.
	open := cl.conns[:0]
	var live []*conn
	for _, c := range cl.conns {
		closed, usable := c.state()
		if !closed {
			open = append(open, c)
		}
		if usable {
			live = append(live, c)
		}
	}
	clear(cl.conns[len(open):])
	cl.conns = open
	if len(live) == 0 || len(live) < cl.cfg.Conns && !any {
		return nil, nil
	}
	for range len(live) {
		cl.next = (cl.next + 1) % len(live)
		if s := live[cl.next].open(req, h); s != nil {
			return s, nil
		}
	}
	return nil, nil
}

// dial adds a connection, after the backoff if the last dial failed.
// The caller holds the dialing semaphore: one dial at a time.
func (cl *Client) dial(ctx context.Context) error {
	cl.mu.Lock()
	fails := cl.fails
	cl.mu.Unlock()
	if fails > 0 {
		if err := cl.cfg.Backoff.Wait(ctx, cl.cfg.Clock, fails); err != nil {
			return err
		}
	}
	c, err := cl.connect(ctx)
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if err != nil {
		cl.fails++
		return err
	}
	cl.fails = 0
	cl.conns = append(cl.conns, c)
	return nil
}

// Close fails every stream with ErrClosed, closes the connections and
// waits for every goroutine the client started.
func (cl *Client) Close() error {
	cl.mu.Lock()
	cl.closed = true
	conns := cl.conns
	cl.conns = nil
	cl.mu.Unlock()
	for _, c := range conns {
		c.fail(ErrClosed)
	}
	cl.wg.Wait()
	return nil
}

// Conns is how many connections are open (diagnostics, tests).
func (cl *Client) Conns() int {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	n := 0
	for _, c := range cl.conns {
		if _, usable := c.state(); usable {
			n++
		}
	}
	return n
}
