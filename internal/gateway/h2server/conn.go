package h2server

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// connWindow is the connection-level receive window the server opens at
// the start: the streams' windows bound what is buffered, so this one is
// only a counter.
const connWindow = 1 << 30

// lingerTime is how long lingerClose reads after a refusal.
const lingerTime = time.Second

// errConnClosed is a stream's end when its connection ended.
var errConnClosed = errors.New("h2server: connection closed")

// errHandedOff ends serve for a connection Config.Other took.
var errHandedOff = errors.New("h2server: handed to Config.Other")

// conn is one client connection. Its goroutine (serve) reads frames; any
// goroutine writes under mu.
type conn struct {
	srv   *Server
	cfg   *Config
	clock clock.Clock
	nc    net.Conn // the TLS connection once the handshake is done
	raw   net.Conn
	state *tls.ConnectionState
	hdec  *hpack.Decoder
	peek  [1]byte

	// timers counts the armed timer callbacks; serve waits for them.
	timers sync.WaitGroup

	mu          sync.Mutex
	streams     map[uint32]*Stream
	maxStreamID uint32
	closed      bool
	ready       bool // the TLS handshake is done: frames can be written
	goingAway   bool // GOAWAY sent: no new streams
	goAwayID    uint32
	linger      bool // refused: lingerClose
	// peer's settings
	peerWindow   int64
	peerMaxFrame uint32
	// flow control: what the client may still send us on the connection,
	// what it consumed that we have not granted back, and what we may send
	sendWindow  int64
	recvWindow  int64
	recvUnacked int64
	// the control-frame budget's window
	budgetStart time.Time
	budgetUsed  int
	idle        clock.Timer
	idleGen     uint64
	handshake   clock.Timer
	// keepalive: the timer, the last frame's time (UnixNano, atomic: set
	// per frame without the lock) and the PING awaiting its ACK
	ping        clock.Timer
	pingGen     uint64
	lastRead    atomic.Int64
	pingWaiting bool
	pingData    [8]byte
	// notify lists the streams with events for their handlers (unlock).
	notify []*Stream

	// Writes never wait for the network: frames are encoded into out
	// (taken from a pool when there is something to write) and the
	// flusher goroutine, started when out gets bytes and none runs,
	// writes them and ends once out is empty. buffered counts the bytes
	// in out and in the batch being written; past MaxWriteBuffer, DATA
	// waits in its stream's queue (dataWaits) and the reader reads no
	// more frames (room) until it drains. werr is the write that failed
	// (the connection is closed); closeWhenFlushed closes it once the
	// flusher has written what is pending.
	out              *pending
	buffered         int
	flushing         bool
	dataWaits        bool
	closeWhenFlushed bool
	werr             error
	room             sync.Cond
	readPaused       bool // the reader waits for room
	// flusher counts the flusher goroutine; serve waits for it.
	flusher sync.WaitGroup
}

func newConn(s *Server, nc net.Conn) *conn {
	c := &conn{
		srv: s, cfg: &s.cfg, clock: s.cfg.Clock, nc: nc, raw: nc,
		streams:      map[uint32]*Stream{},
		peerWindow:   65535,
		peerMaxFrame: maxFrameSize,
		sendWindow:   65535,
		recvWindow:   65535,
	}
	c.room.L = &c.mu
	c.hdec = hpack.NewDecoder(4096, nil)
	c.hdec.SetMaxStringLength(int(s.cfg.MaxHeaderListSize))
	return c
}

// arm runs f after d on the clock; serve waits for callbacks in flight.
func (c *conn) arm(d time.Duration, f func()) clock.Timer {
	c.timers.Add(1)
	return c.clock.AfterFunc(d, func() {
		defer c.timers.Done()
		f()
	})
}

// disarm stops t if it has not fired yet.
func (c *conn) disarm(t clock.Timer) {
	if t != nil && t.Stop() {
		c.timers.Done()
	}
}

// serve runs the connection to its end.
func (c *conn) serve() {
	c.handshake = c.arm(c.cfg.HandshakeTimeout, func() { c.raw.Close() })
	err := c.start()
	if err == nil {
		err = c.readLoop()
	}
	c.mu.Lock()
	c.disarm(c.handshake)
	c.handshake = nil
	c.closeLocked()
	linger := c.linger
	c.unlock()
	if errors.Is(err, errHandedOff) {
		c.timers.Wait()
		return
	}
	// What was encoded before the end (a GOAWAY, a stream's last frames)
	// goes out first, within WriteTimeout.
	c.flusher.Wait()
	if linger {
		lingerClose(c.raw)
	}
	c.raw.Close()
	c.timers.Wait()
}

// lingerClose ends a connection the server refused: it stops writing and
// reads what the client still sends, a little while, so that the client
// reads the GOAWAY before the end instead of a reset.
func lingerClose(nc net.Conn) {
	cw, ok := nc.(interface{ CloseWrite() error })
	if !ok || cw.CloseWrite() != nil {
		return
	}
	// The kernel's clock: a socket deadline.
	_ = nc.SetReadDeadline(time.Now().Add(lingerTime))
	_, _ = io.Copy(io.Discard, io.LimitReader(nc, 256<<10))
}

// start runs the TLS handshake, sends the server's SETTINGS, reads the
// client preface and the client's first SETTINGS, all under the
// handshake timer.
func (c *conn) start() error {
	if c.cfg.TLS != nil {
		tc := tls.Server(c.raw, c.cfg.TLS)
		if err := tc.Handshake(); err != nil {
			if c.cfg.ErrorLog != nil {
				c.cfg.ErrorLog.Printf("http: TLS handshake error from %s: %v", c.raw.RemoteAddr(), err)
			}
			return err
		}
		st := tc.ConnectionState()
		if st.NegotiatedProtocol != "h2" {
			if c.cfg.Other == nil {
				return fmt.Errorf("h2server: client negotiated %q, not h2", st.NegotiatedProtocol)
			}
			c.mu.Lock()
			c.disarm(c.handshake)
			c.handshake = nil
			c.closed = true
			c.mu.Unlock()
			c.cfg.Other(tc)
			return errHandedOff
		}
		c.mu.Lock()
		c.nc, c.state = tc, &st
		c.mu.Unlock()
	}
	c.mu.Lock()
	c.ready = true // frames may be written from now on
	c.mu.Unlock()
	err := c.write(func(fr *http2.Framer) error {
		if err := fr.WriteSettings(
			http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: c.cfg.MaxConcurrentStreams},
			http2.Setting{ID: http2.SettingInitialWindowSize, Val: c.cfg.InitialWindowSize},
			http2.Setting{ID: http2.SettingMaxFrameSize, Val: maxFrameSize},
			http2.Setting{ID: http2.SettingMaxHeaderListSize, Val: c.cfg.MaxHeaderListSize},
		); err != nil {
			return err
		}
		return fr.WriteWindowUpdate(0, connWindow-65535)
	})
	if err != nil {
		return err
	}
	c.recvWindow = connWindow
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(c.nc, preface[:]); err != nil {
		return err
	}
	if string(preface[:]) != http2.ClientPreface {
		c.linger = true
		return errors.New("h2server: bad client preface")
	}
	// The first frame must be SETTINGS (RFC 9113 3.4).
	return c.readFrame(func(f http2.Frame) error {
		sf, ok := f.(*http2.SettingsFrame)
		if !ok || sf.IsAck() {
			return http2.ConnectionError(http2.ErrCodeProtocol)
		}
		c.mu.Lock()
		c.disarm(c.handshake)
		c.handshake = nil
		c.armIdleLocked()
		c.armPingLocked(c.cfg.PingInterval)
		c.mu.Unlock()
		return c.onSettings(sf)
	})
}

// readLoop reads and handles frames until the connection fails or ends.
func (c *conn) readLoop() error {
	for {
		if err := c.waitRoom(); err != nil {
			return err
		}
		if err := c.readFrame(c.process); err != nil {
			return err
		}
	}
}

// waitRoom holds the reader while the connection's write buffer is over
// MaxWriteBuffer: a client that sends but does not read gets no more
// answers queued (only this connection's goroutine waits). It returns the
// failed write's error.
func (c *conn) waitRoom() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.buffered > c.cfg.MaxWriteBuffer && c.werr == nil {
		c.readPaused = true
		c.room.Wait()
	}
	c.readPaused = false
	return c.werr
}

// readFramer is a frame reader taken from a pool for one frame: its read
// buffer (up to a frame) is not kept by an idle connection.
type readFramer struct {
	fr  *http2.Framer
	src prefixReader
}

type prefixReader struct {
	b []byte
	r io.Reader
}

func (p *prefixReader) Read(b []byte) (int, error) {
	if len(p.b) > 0 {
		n := copy(b, p.b)
		p.b = p.b[n:]
		return n, nil
	}
	return p.r.Read(b)
}

var readFramers = sync.Pool{New: func() any {
	rf := &readFramer{}
	rf.fr = http2.NewFramer(nil, &rf.src)
	rf.fr.SetMaxReadFrameSize(maxFrameSize)
	return rf
}}

// readFrame waits for the next frame's first byte with no buffer held,
// then reads the frame with a pooled Framer and hands it to handle (the
// frame is valid only during the call). Stream errors reset the stream
// and return nil; connection errors send GOAWAY and are returned.
func (c *conn) readFrame(handle func(http2.Frame) error) error {
	if _, err := io.ReadFull(c.nc, c.peek[:]); err != nil {
		return err
	}
	rf := readFramers.Get().(*readFramer)
	rf.src = prefixReader{b: c.peek[:], r: c.nc}
	rf.fr.ReadMetaHeaders = c.hdec
	rf.fr.MaxHeaderListSize = c.cfg.MaxHeaderListSize
	f, err := rf.fr.ReadFrame()
	c.lastRead.Store(c.clock.Now().UnixNano())
	if err == nil {
		err = handle(f)
		rf.fr.ReadMetaHeaders = nil
		rf.src = prefixReader{}
		readFramers.Put(rf)
	}
	// A Framer that failed may be mid header block: it is dropped.
	return c.frameError(err)
}

// frameError answers a failed frame: a stream error with RST_STREAM (the
// connection goes on), a connection error with GOAWAY.
func (c *conn) frameError(err error) error {
	if err == nil {
		return nil
	}
	var se http2.StreamError
	if errors.As(err, &se) {
		c.resetStream(se.StreamID, se.Code)
		return c.frameError(c.spend()) // each reset the client causes counts
	}
	code := http2.ErrCodeProtocol
	var ce http2.ConnectionError
	switch {
	case errors.As(err, &ce):
		code = http2.ErrCode(ce)
	case errors.Is(err, http2.ErrFrameTooLarge):
		code = http2.ErrCodeFrameSize
	default:
		return err // the network's
	}
	c.sendGoAway(code)
	return err
}

// sendGoAway writes GOAWAY with the last stream taken and stops new
// streams.
func (c *conn) sendGoAway(code http2.ErrCode) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return
	}
	c.goingAway = true
	c.goAwayID = c.maxStreamID
	c.linger = true
	_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteGoAway(c.maxStreamID, code, nil) })
}

// goAway is Shutdown's: GOAWAY NO_ERROR, and the connection closes at
// once if it has no stream, else when its last stream ends.
func (c *conn) goAway() {
	c.mu.Lock()
	if c.closed || c.goingAway {
		c.mu.Unlock()
		return
	}
	if !c.ready {
		c.mu.Unlock()
		c.raw.Close() // still in its TLS handshake
		return
	}
	c.goingAway = true
	c.goAwayID = c.maxStreamID
	_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteGoAway(c.maxStreamID, http2.ErrCodeNo, nil) })
	if len(c.streams) == 0 {
		c.closeAfterFlushLocked()
	}
	c.mu.Unlock()
}

// spend counts one control frame against the connection's budget; over
// it, the connection is told to calm down and ends.
func (c *conn) spend() error {
	c.mu.Lock()
	now := c.clock.Now()
	if now.Sub(c.budgetStart) >= time.Second {
		c.budgetStart, c.budgetUsed = now, 0
	}
	c.budgetUsed++
	over := c.budgetUsed > c.cfg.ControlFramesPerSecond
	c.mu.Unlock()
	if over {
		return http2.ConnectionError(http2.ErrCodeEnhanceYourCalm)
	}
	return nil
}

// armIdleLocked starts the idle timer (no stream open).
func (c *conn) armIdleLocked() {
	if c.idle != nil || c.closed {
		return
	}
	c.idleGen++
	gen := c.idleGen
	c.idle = c.arm(c.cfg.IdleTimeout, func() {
		c.mu.Lock()
		if !c.closed && c.idleGen == gen && len(c.streams) == 0 {
			c.goingAway = true
			_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WriteGoAway(c.maxStreamID, http2.ErrCodeNo, nil) })
			c.closeAfterFlushLocked()
		}
		c.mu.Unlock()
	})
}

func (c *conn) disarmIdleLocked() {
	if c.idle != nil {
		c.disarm(c.idle)
		c.idle = nil
		c.idleGen++
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
		c.out = pendings.Get().(*pending)
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
	w.hbuf.Reset()
	return w
}}

// pending is a batch of encoded frames and, per DATA frame, the stream
// to tell (Sent) once they are written.
type pending struct {
	b    []byte
	sent []sentNote
}

type sentNote struct {
	s *Stream
	n int
}

// maxPooledPending: a larger buffer (frames queued past MaxWriteBuffer)
// is dropped rather than kept in the pool.
const maxPooledPending = 256 << 10

var pendings = sync.Pool{New: func() any { return &pending{b: make([]byte, 0, 4<<10)} }}

func putPending(p *pending) {
	if cap(p.b) > maxPooledPending {
		return
	}
	clear(p.sent)
	p.b, p.sent = p.b[:0], p.sent[:0]
	pendings.Put(p)
}

// noteSentLocked records that n bytes of s's DATA are in the write
// buffer: s's handler hears of them (Sent) once they are written.
func (c *conn) noteSentLocked(s *Stream, n int) {
	if k := len(c.out.sent) - 1; k >= 0 && c.out.sent[k].s == s {
		c.out.sent[k].n += n
		return
	}
	c.out.sent = append(c.out.sent, sentNote{s: s, n: n})
}

// write takes mu and writes the frames f makes.
func (c *conn) write(f func(*http2.Framer) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.writeLocked(f)
}

// writeLocked encodes the frames f makes into the write buffer, for the
// flusher. It never waits for the network.
func (c *conn) writeLocked(f func(*http2.Framer) error) error {
	return c.withWriter(func(w *writer) error { return f(w.fr) })
}

func (c *conn) withWriter(f func(*writer) error) error {
	if c.closed || !c.ready {
		return errConnClosed
	}
	if c.werr != nil {
		return c.werr
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
		c.raw.Close()
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
// batch, each within WriteTimeout (a failed or late write closes the
// connection), tells the streams what was written, and ends once the
// buffer is empty, returning it to the pool.
func (c *conn) flush() {
	defer c.flusher.Done()
	c.mu.Lock()
	for c.out != nil && c.werr == nil {
		batch := c.out
		c.out = nil
		c.mu.Unlock()
		// SECURITY: a client that does not read holds this goroutine
		// only, and only this long. The kernel's clock: a socket
		// deadline.
		_ = c.nc.SetWriteDeadline(time.Now().Add(c.cfg.WriteTimeout))
		_, err := c.nc.Write(batch.b)
		c.mu.Lock()
		c.buffered -= len(batch.b)
		if err != nil {
			c.failLocked(err)
		} else {
			for _, n := range batch.sent {
				if !n.s.ended {
					n.s.unreported += n.n
					c.noteLocked(n.s)
				}
			}
		}
		putPending(batch)
		if c.dataWaits && c.werr == nil {
			c.dataWaits = false
			c.flushAllLocked()
		}
		c.room.Broadcast()
		if len(c.notify) > 0 {
			c.unlock() // the handlers' Sent, without the lock
			c.mu.Lock()
		}
	}
	c.flushing = false
	closeNow := c.closeWhenFlushed
	c.mu.Unlock()
	if closeNow {
		c.raw.Close()
	}
}

// failLocked ends the connection after a failed write: what is pending
// is dropped, the reader and the writers are told.
func (c *conn) failLocked(err error) {
	c.werr = err
	if c.out != nil {
		c.buffered -= len(c.out.b)
		putPending(c.out)
		c.out = nil
	}
	c.raw.Close()
	c.room.Broadcast()
}

// closeAfterFlushLocked closes the connection once what is pending is
// written (at once if nothing is).
func (c *conn) closeAfterFlushLocked() {
	if c.flushing {
		c.closeWhenFlushed = true
		return
	}
	c.raw.Close()
}

// encodeHeaders HPACK-encodes fields into w.hbuf and writes them as
// HEADERS and CONTINUATION frames.
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

// closeLocked ends the connection's streams and timers.
func (c *conn) closeLocked() {
	if c.closed {
		return
	}
	c.closed = true
	c.disarmIdleLocked()
	c.disarm(c.ping)
	c.ping = nil
	c.pingGen++
	for _, s := range c.streams {
		s.endLocked(errConnClosed)
	}
}

// flushAllLocked writes what the windows now allow of every stream's
// queued data.
func (c *conn) flushAllLocked() {
	for _, s := range c.streams {
		if len(s.out) > 0 || s.outEnd {
			s.flushLocked()
		}
	}
}

// armPingLocked arms the keepalive timer to look again after d.
func (c *conn) armPingLocked(d time.Duration) {
	if c.closed {
		return
	}
	c.disarm(c.ping)
	c.pingGen++
	gen := c.pingGen
	c.ping = c.arm(d, func() {
		c.mu.Lock()
		if c.closed || c.pingGen != gen {
			c.mu.Unlock()
			return
		}
		c.ping = nil
		if c.pingWaiting {
			// No ACK within PingTimeout: the client is gone.
			c.mu.Unlock()
			c.raw.Close()
			return
		}
		quiet := c.clock.Now().Sub(time.Unix(0, c.lastRead.Load()))
		if quiet < c.cfg.PingInterval {
			c.armPingLocked(c.cfg.PingInterval - quiet)
			c.mu.Unlock()
			return
		}
		c.pingWaiting = true
		c.pingData[0]++
		_ = c.writeLocked(func(fr *http2.Framer) error { return fr.WritePing(false, c.pingData) })
		c.armPingLocked(c.cfg.PingTimeout)
		c.mu.Unlock()
	})
}

// onPingAck ends the wait for the server's PING.
func (c *conn) onPingAck(data [8]byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pingWaiting && data == c.pingData {
		c.pingWaiting = false
		c.armPingLocked(c.cfg.PingInterval)
	}
}
