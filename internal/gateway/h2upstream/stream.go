package h2upstream

import (
	"encoding/binary"
	"math/bits"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/gateway/grpcmsg"
)

// Request is a stream's request: POST to Path with content-type
// application/grpc and te trailers, and Header's fields (lower-cased;
// connection-specific ones dropped).
type Request struct {
	Path string
	// Authority defaults to Config.Addr's host.
	Authority string
	Header    http.Header
}

// Handler receives one stream's events. No method is called with the
// connection's lock held, and none may block: OnHeaders and OnMessage run
// on the connection's goroutine; OnSent on its flusher; the end
// (OnTrailers or OnReset) on whichever goroutine ended the stream, so
// they may run alongside OnMessage.
type Handler interface {
	// OnHeaders hands over the response's headers (status 200).
	OnHeaders(s *Stream, h http.Header)
	// OnMessage hands over one gRPC message, valid only during the call.
	// Its window bytes hold the stream's receive window until the
	// handler calls s.Consumed(window).
	OnMessage(s *Stream, msg []byte, window int)
	// OnSent reports that n more bytes queued by Send were written to
	// the connection (not after the stream's end).
	OnSent(s *Stream, n int)
	// OnTrailers is the stream's end with a gRPC status: the trailers, a
	// trailers-only answer, or a non-200 HTTP status mapped to a code.
	OnTrailers(s *Stream, st Status)
	// OnReset is the stream's end without a status: RST_STREAM
	// (StreamResetError), GOAWAY (GoAwayError; IsRetryable), the
	// connection's failure, ErrStalled, ErrMessageTooLarge,
	// ErrCompressed, ErrClosed.
	// Exactly one of OnTrailers and OnReset is called, once.
	OnReset(s *Stream, err error)
}

// Stream is one request stream. Its methods are safe from any goroutine.
type Stream struct {
	c  *conn
	id uint32
	h  Handler
	// msgs is the connection goroutine's.
	msgs grpcmsg.Messages
	// done is ended, for the connection's goroutine between frames.
	done atomic.Bool
	// The rest is under c.mu.
	sendWindow  int64
	recvWindow  int64
	recvUnacked int64
	gotHeaders  bool
	remoteDone  bool
	localDone   bool // END_STREAM written
	rstSent     bool
	// out is the data waiting for window, in a pooled buffer; nil when
	// none.
	out    *[]byte
	outOff int
	outEnd bool // CloseSend called
	ended  bool
	stall  interface{ Stop() bool }
	gen    uint64
}

// ID is the stream's HTTP/2 id.
func (s *Stream) ID() uint32 { return s.id }

// open opens a stream on c if the server's MAX_CONCURRENT_STREAMS
// allows; nil if not.
func (c *conn) open(req Request, h Handler) *Stream {
	c.mu.Lock()
	defer c.unlock()
	if c.closed || c.goingAway || uint32(len(c.streams)) >= c.maxStreams || c.nextID >= 1<<31-1 {
		return nil
	}
	s := &Stream{c: c, id: c.nextID, h: h, sendWindow: c.peerWindow, recvWindow: int64(c.cfg.InitialWindowSize),
		msgs: grpcmsg.Messages{Max: c.cfg.MaxMessageSize}}
	c.nextID += 2
	c.streams[s.id] = s
	fields := c.requestFields(req)
	if err := c.writeLocked(func(w *writer) error { return c.encodeHeaders(w, s.id, false, fields) }); err != nil {
		s.endLocked(c.errLocked(), nil)
	}
	return s
}

// connHeaders are dropped from Request.Header.
var connHeaders = map[string]bool{"connection": true, "keep-alive": true, "proxy-connection": true,
	"transfer-encoding": true, "upgrade": true, "te": true, "content-type": true, "host": true}

func (c *conn) requestFields(req Request) []hpack.HeaderField {
	auth := req.Authority
	if auth == "" {
		auth, _, _ = net.SplitHostPort(c.cfg.Addr)
	}
	scheme := "https"
	if c.cfg.TLS == nil {
		scheme = "http"
	}
	f := make([]hpack.HeaderField, 0, 6+len(req.Header))
	f = append(f, hpack.HeaderField{Name: ":method", Value: "POST"}, hpack.HeaderField{Name: ":scheme", Value: scheme},
		hpack.HeaderField{Name: ":path", Value: req.Path}, hpack.HeaderField{Name: ":authority", Value: auth},
		hpack.HeaderField{Name: "content-type", Value: "application/grpc"}, hpack.HeaderField{Name: "te", Value: "trailers"})
	for k, vs := range req.Header {
		k = strings.ToLower(k)
		if connHeaders[k] {
			continue
		}
		for _, v := range vs {
			f = append(f, hpack.HeaderField{Name: k, Value: v})
		}
	}
	return f
}

// bufClasses are the capacities of the pooled queues, 1 KiB to 64 KiB;
// a larger queue is allocated and left to the GC.
const (
	minBufShift = 10
	maxBufShift = 16
)

// bufs are the queues of streams waiting for window, one pool per
// capacity: a burst of streams waiting with small messages takes small
// buffers.
var bufs [maxBufShift - minBufShift + 1]sync.Pool

// getBuf returns an empty buffer of capacity at least n.
func getBuf(n int) *[]byte {
	shift := max(minBufShift, bits.Len(uint(n-1)))
	if shift > maxBufShift {
		b := make([]byte, 0, n)
		return &b
	}
	if b, ok := bufs[shift-minBufShift].Get().(*[]byte); ok {
		return b
	}
	b := make([]byte, 0, 1<<shift)
	return &b
}

// putBuf returns b to its pool.
func putBuf(b *[]byte) {
	c := cap(*b)
	shift := bits.Len(uint(c)) - 1
	if c != 1<<shift || shift < minBufShift || shift > maxBufShift {
		return
	}
	*b = (*b)[:0]
	bufs[shift-minBufShift].Put(b)
}

// releaseOutLocked returns the stream's queue to its pool.
func (s *Stream) releaseOutLocked() {
	if s.out != nil {
		putBuf(s.out)
		s.out, s.outOff = nil, 0
	}
}

// Send queues msg as one gRPC message (uncompressed) and hands what the
// server's windows and the connection's write buffer allow now to the
// connection's flusher; the rest waits, in a pooled buffer. It never
// waits for flow control or for the network: past MaxQueuedBytes waiting
// it returns ErrQueueFull and queues nothing. OnSent reports the bytes
// once written to the connection.
func (s *Stream) Send(msg []byte) error {
	c := s.c
	c.mu.Lock()
	defer c.unlock()
	switch {
	case s.ended:
		return ErrStreamEnded
	case s.outEnd:
		return ErrSendClosed
	case s.queuedLocked()+5+len(msg) > c.cfg.MaxQueuedBytes+int(max(0, min(s.sendWindow, c.sendWindow, int64(c.cfg.MaxWriteBuffer-c.buffered)))):
		return ErrQueueFull
	}
	need := s.queuedLocked() + 5 + len(msg)
	if s.out == nil || cap(*s.out)-s.outOff < need {
		nb := getBuf(need)
		if s.out != nil {
			*nb = append(*nb, (*s.out)[s.outOff:]...)
			putBuf(s.out)
		}
		s.out, s.outOff = nb, 0
	} else if cap(*s.out)-len(*s.out) < 5+len(msg) {
		n := copy(*s.out, (*s.out)[s.outOff:]) // slide the queue to the front
		*s.out, s.outOff = (*s.out)[:n], 0
	}
	b := append(*s.out, 0)
	b = binary.BigEndian.AppendUint32(b, uint32(len(msg)))
	*s.out = append(b, msg...)
	s.flushLocked()
	return nil
}

// CloseSend ends the client's side once its queued data is written.
func (s *Stream) CloseSend() error {
	c := s.c
	c.mu.Lock()
	defer c.unlock()
	if s.ended {
		return ErrStreamEnded
	}
	if s.outEnd {
		return ErrSendClosed
	}
	s.outEnd = true
	s.flushLocked()
	return nil
}

// Reset ends the stream with RST_STREAM CANCEL; the handler's OnReset
// follows.
func (s *Stream) Reset() {
	s.c.mu.Lock()
	if !s.ended {
		s.c.resetLocked(s, http2.ErrCodeCancel, nil)
	}
	s.c.unlock()
}

// Consumed returns n bytes of the stream's receive window to the server
// (in batches of half the window).
func (s *Stream) Consumed(n int) {
	s.c.mu.Lock()
	s.consumeLocked(int64(n))
	s.c.unlock()
}

func (s *Stream) consumeLocked(n int64) {
	if n <= 0 || s.ended || s.remoteDone {
		return
	}
	s.recvUnacked += n
	if s.recvUnacked < int64(s.c.cfg.InitialWindowSize)/2 {
		return
	}
	inc := s.recvUnacked
	s.recvUnacked = 0
	s.recvWindow += inc
	_ = s.c.writeLocked(func(w *writer) error { return w.fr.WriteWindowUpdate(s.id, uint32(inc)) })
}

// Queued is how many bytes wait for the server's window or for room in
// the connection's write buffer.
func (s *Stream) Queued() int {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.queuedLocked()
}

func (s *Stream) queuedLocked() int {
	if s.out == nil {
		return 0
	}
	return len(*s.out) - s.outOff
}

// flushLocked hands what the windows and the connection's write buffer
// allow of the queued data to the flusher, then the end of the client's
// side once nothing waits.
func (s *Stream) flushLocked() {
	c := s.c
	if s.ended || s.localDone {
		return
	}
	sent := 0
	err := c.writeLocked(func(w *writer) error {
		for s.queuedLocked() > 0 {
			n := int(min(int64(s.queuedLocked()), s.sendWindow, c.sendWindow, int64(min(c.peerMaxFrame, maxFrameSize))))
			if n <= 0 {
				break
			}
			if c.buffered >= c.cfg.MaxWriteBuffer {
				c.dataWaits = true // the flusher comes back once it drained
				break
			}
			last := n == s.queuedLocked() && s.outEnd
			if err := w.fr.WriteData(s.id, last, (*s.out)[s.outOff:s.outOff+n]); err != nil {
				return err
			}
			c.noteSentLocked(s, n)
			s.outOff += n
			s.sendWindow -= int64(n)
			c.sendWindow -= int64(n)
			sent += n
			s.localDone = last
		}
		if s.queuedLocked() > 0 || !s.outEnd || s.localDone {
			return nil
		}
		s.localDone = true
		return w.fr.WriteData(s.id, true, nil)
	})
	if s.out != nil && s.queuedLocked() == 0 {
		s.releaseOutLocked()
	}
	switch {
	case err != nil:
		s.endLocked(c.errLocked(), nil)
	case s.queuedLocked() == 0:
		s.stopStallLocked()
	case sent > 0 || s.stall == nil:
		s.armStallLocked()
	}
}

// armStallLocked (re)starts the timer that resets the stream if its
// queued data makes no progress.
func (s *Stream) armStallLocked() {
	s.stopStallLocked()
	gen := s.gen
	c := s.c
	s.stall = c.arm(c.cfg.StreamStallTimeout, func() {
		c.mu.Lock()
		if !s.ended && s.gen == gen && s.queuedLocked() > 0 {
			c.resetLocked(s, http2.ErrCodeCancel, ErrStalled)
		}
		c.unlock()
	})
}

func (s *Stream) stopStallLocked() {
	if s.stall != nil {
		if s.stall.Stop() {
			s.c.cl.wg.Done()
		}
		s.stall = nil
	}
	s.gen++
}

// resetLocked writes RST_STREAM and ends s with err (or the reset).
func (c *conn) resetLocked(s *Stream, code http2.ErrCode, err error) {
	if s.ended {
		return
	}
	if !s.rstSent && !c.closed {
		s.rstSent = true
		_ = c.writeLocked(func(w *writer) error { return w.fr.WriteRSTStream(s.id, code) })
	}
	if err == nil {
		err = StreamResetError{Code: code}
	}
	s.endLocked(err, nil)
}

// endLocked removes the stream and queues its handler's end: OnTrailers
// with st, or OnReset with err. A stream the server ended while the
// client still had its side open is reset (CANCEL), to free the server's
// slot.
func (s *Stream) endLocked(err error, st *Status) {
	if s.ended {
		return
	}
	c := s.c
	if !s.localDone && !s.rstSent && !c.closed {
		s.rstSent = true
		_ = c.writeLocked(func(w *writer) error { return w.fr.WriteRSTStream(s.id, http2.ErrCodeCancel) })
	}
	s.ended = true
	s.done.Store(true)
	s.stopStallLocked()
	s.releaseOutLocked()
	delete(c.streams, s.id)
	h := s.h
	if st != nil {
		stv := *st
		c.pending = append(c.pending, func() { h.OnTrailers(s, stv) })
	} else {
		c.pending = append(c.pending, func() { h.OnReset(s, err) })
	}
	if c.goingAway && len(c.streams) == 0 && !c.closed {
		if c.err == nil {
			c.err = ErrConnClosed
		}
		c.closeLocked()
	}
}
