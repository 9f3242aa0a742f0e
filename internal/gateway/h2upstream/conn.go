package h2upstream

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// conn is one connection. Its goroutine (run) reads frames; any goroutine
// encodes frames under mu into its write buffer, which its flusher
// goroutine writes.
type conn struct {
	cl  *Client
	cfg *Config
	raw net.Conn
	// fr reads frames; only run uses it.
	fr *http2.Framer

	mu           sync.Mutex
	streams      map[uint32]*Stream
	nextID       uint32
	maxStreams   uint32 // the server's MAX_CONCURRENT_STREAMS
	peerWindow   int64  // the server's INITIAL_WINDOW_SIZE
	peerMaxFrame uint32
	sendWindow   int64 // connection-level
	recvUnacked  int64 // connection-level bytes to return
	goingAway    bool
	closed       bool
	err          error // why it closed
	// pending are handler calls to make once mu is released.
	pending []func()
	// ping: the keepalive's state.
	frames     uint64 // frames read, for the keepalive
	pingFrames uint64
	pingOut    bool
	pingTimer  clock.Timer

	// Writes never wait for the network: frames are encoded into out
	// (taken from a pool when there is something to write) and the
	// flusher goroutine, started when out gets bytes and none runs,
	// writes them and ends once out is empty. buffered counts the bytes
	// in out and in the batch being written; past MaxWriteBuffer, DATA
	// waits in its stream's queue (dataWaits). stopWrites: GOAWAY is
	// encoded, nothing more is.
	out        *batch
	buffered   int
	flushing   bool
	dataWaits  bool
	stopWrites bool
	// flusher counts the flusher goroutine; run waits for it.
	flusher sync.WaitGroup
}

// connect dials, runs the TLS handshake, exchanges the prefaces and
// SETTINGS, and starts the connection's goroutine.
func (cl *Client) connect(ctx context.Context) (*conn, error) {
	cfg := &cl.cfg
	ctx, cancel := context.WithTimeout(ctx, cfg.HandshakeTimeout)
	defer cancel()
	raw, err := cfg.Dial(ctx, "tcp", cfg.Addr)
	if err != nil {
		return nil, err
	}
	if cfg.TLS != nil {
		tc := cfg.TLS.Clone()
		tc.NextProtos = []string{http2.NextProtoTLS}
		if tc.ServerName == "" {
			tc.ServerName, _, _ = net.SplitHostPort(cfg.Addr)
		}
		t := tls.Client(raw, tc)
		if err := t.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		if p := t.ConnectionState().NegotiatedProtocol; p != http2.NextProtoTLS {
			t.Close()
			return nil, fmt.Errorf("h2upstream: %s negotiated %q, not h2", cfg.Addr, p)
		}
		raw = t
	}
	c := newConn(cl, raw)
	if d, ok := ctx.Deadline(); ok {
		_ = raw.SetDeadline(d)
	}
	if err := c.handshake(); err != nil {
		c.abort()
		return nil, err
	}
	// The flusher sets its own write deadlines.
	_ = raw.SetReadDeadline(time.Time{})
	if c.maxStreams == 0 {
		c.abort()
		return nil, fmt.Errorf("h2upstream: %s allows no stream (MAX_CONCURRENT_STREAMS 0)", cfg.Addr)
	}
	// Under cl.mu: Close, once it set closed, waits for no new goroutine.
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.closed {
		c.abort()
		return nil, ErrClosed
	}
	cl.wg.Add(1)
	go c.run()
	return c, nil
}

func newConn(cl *Client, raw net.Conn) *conn {
	c := &conn{cl: cl, cfg: &cl.cfg, raw: raw, streams: map[uint32]*Stream{}, nextID: 1,
		maxStreams: 1<<32 - 1, peerWindow: 65535, peerMaxFrame: maxFrameSize, sendWindow: 65535}
	// The reader's buffer: one per connection, not one per stream.
	c.fr = http2.NewFramer(io.Discard, bufio.NewReaderSize(raw, cl.cfg.ReadBufferSize))
	c.fr.SetMaxReadFrameSize(maxFrameSize)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(cl.cfg.HeaderTableSize, nil)
	c.fr.MaxHeaderListSize = cl.cfg.MaxHeaderListSize
	return c
}

// handshake writes the preface and the client's SETTINGS, then reads
// the server's first SETTINGS (so MAX_CONCURRENT_STREAMS is known before
// any stream opens).
func (c *conn) handshake() error {
	c.mu.Lock()
	err := c.writeLocked(func(w *writer) error {
		if _, err := w.sink.Write([]byte(http2.ClientPreface)); err != nil {
			return err
		}
		if err := w.fr.WriteSettings(
			http2.Setting{ID: http2.SettingEnablePush, Val: 0},
			http2.Setting{ID: http2.SettingInitialWindowSize, Val: c.cfg.InitialWindowSize},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: c.cfg.MaxHeaderListSize},
			http2.Setting{ID: http2.SettingHeaderTableSize, Val: c.cfg.HeaderTableSize},
		); err != nil {
			return err
		}
		return w.fr.WriteWindowUpdate(0, connWindow-65535)
	})
	c.mu.Unlock()
	if err != nil {
		return err
	}
	f, err := c.fr.ReadFrame()
	if err != nil {
		return err
	}
	sf, ok := f.(*http2.SettingsFrame)
	if !ok || sf.IsAck() {
		return fmt.Errorf("h2upstream: server's first frame is %v, not SETTINGS", f.Header().Type)
	}
	c.mu.Lock()
	defer c.unlock()
	return c.onSettings(sf)
}

// abort closes a connection that never ran and waits for its flusher.
func (c *conn) abort() {
	c.mu.Lock()
	c.closed = true
	c.raw.Close()
	c.mu.Unlock()
	c.flusher.Wait()
}

// state reports whether c is closed, and whether new streams may go to
// it.
func (c *conn) state() (closed, usable bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed, !c.closed && !c.goingAway && c.nextID < 1<<31-1
}

// arm runs f after d on the clock; Close waits for callbacks in flight.
func (c *conn) arm(d time.Duration, f func()) clock.Timer {
	c.cl.wg.Add(1)
	return c.cfg.Clock.AfterFunc(d, func() {
		defer c.cl.wg.Done()
		f()
	})
}

// disarm stops t if it has not fired yet.
func (c *conn) disarm(t clock.Timer) {
	if t != nil && t.Stop() {
		c.cl.wg.Done()
	}
}

// run reads frames until the connection fails, then ends its streams.
func (c *conn) run() {
	defer c.cl.wg.Done()
	c.mu.Lock()
	c.armPingLocked()
	c.mu.Unlock()
	err := c.readLoop()
	c.mu.Lock()
	drain := c.stopWrites
	c.mu.Unlock()
	if drain {
		c.flusher.Wait() // the GOAWAY goes out first, within WriteTimeout
	}
	c.mu.Lock()
	if c.err == nil {
		c.err = fmt.Errorf("%w: %w", ErrConnClosed, err)
	}
	c.closeLocked()
	for _, s := range c.streams {
		s.endLocked(c.err, nil)
	}
	c.unlock()
	c.flusher.Wait()
}

// readLoop reads and handles frames until one fails.
func (c *conn) readLoop() error {
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				c.mu.Lock()
				if s := c.streams[se.StreamID]; s != nil {
					c.resetLocked(s, se.Code, err)
				}
				c.unlock()
				continue
			}
			if ce, ok := err.(http2.ConnectionError); ok {
				c.goAway(http2.ErrCode(ce))
			}
			return err
		}
		if err := c.process(f); err != nil {
			var ce http2.ConnectionError
			if errors.As(err, &ce) {
				c.goAway(http2.ErrCode(ce))
			}
			return err
		}
	}
}

// goAway tells the server why the client ends the connection; nothing
// is written after it.
func (c *conn) goAway(code http2.ErrCode) {
	c.mu.Lock()
	_ = c.writeLocked(func(w *writer) error { return w.fr.WriteGoAway(0, code, nil) })
	c.stopWrites = true
	c.mu.Unlock()
}

// fail ends the connection with err: its goroutine ends the streams.
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		c.err = err
	}
	c.closeLocked()
	c.mu.Unlock()
}

func (c *conn) closeLocked() {
	if !c.closed {
		c.closed = true
		c.raw.Close()
		c.disarm(c.pingTimer)
		c.pingTimer = nil
	}
}

// unlock releases mu and then makes the handler calls queued meanwhile.
func (c *conn) unlock() {
	calls := c.pending
	c.pending = nil
	c.mu.Unlock()
	for _, f := range calls {
		f()
	}
}

// writer is a Framer writing into its connection's write buffer, taken
// from a pool for one write, with an HPACK encoder that never indexes (no
// dynamic table: no per-connection encoder state).
type writer struct {
	sink sink
	fr   *http2.Framer
	hbuf bytes.Buffer
	henc *hpack.Encoder
}

// sink appends the frames a writer's Framer makes to its connection's
// write buffer (the connection's lock is held).
type sink struct{ c *conn }

func (k *sink) Write(p []byte) (int, error) {
	c := k.c
	if c.out == nil {
		c.out = batches.Get().(*batch)
	}
	c.out.b = append(c.out.b, p...)
	c.buffered += len(p)
	return len(p), nil
}

var writers = sync.Pool{New: func() any {
	w := &writer{}
	w.fr = http2.NewFramer(&w.sink, nil)
	w.henc = hpack.NewEncoder(&w.hbuf)
	w.henc.SetMaxDynamicTableSizeLimit(0)
	return w
}}

// batch is encoded frames and, per DATA frame, the stream to tell
// (OnSent) once they are written.
type batch struct {
	b    []byte
	sent []sentNote
}

type sentNote struct {
	s *Stream
	n int
}

// maxPooledBatch: a larger buffer is dropped rather than pooled.
const maxPooledBatch = 256 << 10

var batches = sync.Pool{New: func() any { return &batch{b: make([]byte, 0, 4<<10)} }}

func putBatch(b *batch) {
	if cap(b.b) > maxPooledBatch {
		return
	}
	clear(b.sent)
	b.b, b.sent = b.b[:0], b.sent[:0]
	batches.Put(b)
}

// noteSentLocked records that n bytes of s's DATA are in the write
// buffer: its handler hears of them (OnSent) once they are written.
func (c *conn) noteSentLocked(s *Stream, n int) {
	if k := len(c.out.sent) - 1; k >= 0 && c.out.sent[k].s == s {
		c.out.sent[k].n += n
		return
	}
	c.out.sent = append(c.out.sent, sentNote{s: s, n: n})
}

// writeLocked encodes the frames f makes into the write buffer and
// starts the flusher if none runs. It never waits for the network.
func (c *conn) writeLocked(f func(*writer) error) error {
	if c.closed || c.stopWrites {
		return c.errLocked()
	}
	w := writers.Get().(*writer)
	w.sink.c = c
	err := f(w)
	w.sink.c = nil
	w.hbuf.Reset()
	writers.Put(w)
	if err != nil {
		// A frame the Framer refused: the buffer may hold half of what
		// f meant to write.
		if c.err == nil {
			c.err = fmt.Errorf("%w: %w", ErrConnClosed, err)
		}
		c.closeLocked()
		return err
	}
	if !c.flushing && c.out != nil {
		c.flushing = true
		c.flusher.Add(1)
		go c.flush()
	}
	return nil
}

// flush is the flusher goroutine: it writes the write buffer batch by
// batch, each within WriteTimeout (a failed or late write fails the
// connection), tells the streams what was written, and ends once the
// buffer is empty, returning it to the pool.
func (c *conn) flush() {
	defer c.flusher.Done()
	c.mu.Lock()
	for c.out != nil && !c.closed {
		b := c.out
		c.out = nil
		c.mu.Unlock()
		// A server that does not read holds this goroutine only, and
		// only this long: the kernel's clock, a socket deadline.
		_ = c.raw.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout))
		_, err := c.raw.Write(b.b)
		c.mu.Lock()
		c.buffered -= len(b.b)
		if err != nil {
			if c.err == nil {
				c.err = fmt.Errorf("%w: %w", ErrConnClosed, err)
			}
			c.closeLocked()
		} else {
			for _, n := range b.sent {
				if !n.s.ended {
					s, k, h := n.s, n.n, n.s.h
					c.pending = append(c.pending, func() { h.OnSent(s, k) })
				}
			}
		}
		putBatch(b)
		if c.dataWaits && !c.closed {
			c.dataWaits = false
			c.flushAllLocked()
		}
		if len(c.pending) > 0 {
			c.unlock() // the handlers' calls, without the lock
			c.mu.Lock()
		}
	}
	if c.out != nil { // closed: dropped
		c.buffered -= len(c.out.b)
		putBatch(c.out)
		c.out = nil
	}
	c.flushing = false
	c.mu.Unlock()
}

func (c *conn) errLocked() error {
	if c.err != nil {
		return c.err
	}
	return ErrConnClosed
}

// encodeHeaders HPACK-encodes fields and writes them as HEADERS and
// CONTINUATION frames.
func (c *conn) encodeHeaders(w *writer, id uint32, end bool, fields []hpack.HeaderField) error {
	w.hbuf.Reset()
	for _, hf := range fields {
		if err := w.henc.WriteField(hf); err != nil {
			return err
		}
	}
	block := w.hbuf.Bytes()
	max := int(min(c.peerMaxFrame, maxFrameSize))
	first := true
	for first || len(block) > 0 {
		n := min(len(block), max)
		frag := block[:n]
		block = block[n:]
		var err error
		if first {
			err = w.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: frag, EndStream: end, EndHeaders: len(block) == 0})
		} else {
			err = w.fr.WriteContinuation(id, len(block) == 0, frag)
		}
		if err != nil {
			return err
		}
		first = false
	}
	return nil
}

// armPingLocked arms the keepalive: after PingInterval without a frame
// read, a PING; without its ACK within PingTimeout, the connection fails.
func (c *conn) armPingLocked() {
	if c.closed {
		return
	}
	c.pingFrames = c.frames
	c.pingTimer = c.arm(c.cfg.PingInterval, c.pingDue)
}

func (c *conn) pingDue() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.pingOut {
		return
	}
	if c.frames != c.pingFrames {
		c.armPingLocked()
		return
	}
	c.pingOut = true
	if c.writeLocked(func(w *writer) error { return w.fr.WritePing(false, [8]byte{'h', '2', 'u', 'p'}) }) != nil {
		return
	}
	c.pingTimer = c.arm(c.cfg.PingTimeout, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.pingOut && !c.closed {
			c.cfg.Log.Warn("upstream connection answered no PING; closing it", "addr", c.cfg.Addr)
			c.err = ErrPingTimeout
			c.closeLocked()
		}
	})
}

// onPingAck ends the wait for the client's PING.
func (c *conn) onPingAck() {
	if !c.pingOut {
		return
	}
	c.pingOut = false
	c.disarm(c.pingTimer)
	c.armPingLocked()
}
