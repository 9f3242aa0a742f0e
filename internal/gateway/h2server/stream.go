package h2server

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Handler decides how each new stream is served.
type Handler interface {
	// ServeStream is called on the connection's goroutine once a
	// request's headers are in, and must not block. It returns what
	// receives the stream's events; nil discards the request's body (the
	// stream is answered with its methods either way).
	ServeStream(s *Stream) StreamHandler
}

// HandlerFunc is a Handler.
type HandlerFunc func(s *Stream) StreamHandler

// ServeStream calls f.
func (f HandlerFunc) ServeStream(s *Stream) StreamHandler { return f(s) }

// StreamHandler receives one stream's events. No method is called with
// the connection's lock held, and none may block: Data runs on the
// connection's goroutine; Sent on the connection's flusher; Closed on
// whichever goroutine ended the stream (the connection's, its flusher's
// or a caller of the Stream's methods), so they may run alongside Data.
type StreamHandler interface {
	// Data hands over request body bytes, valid only during the call;
	// end reports that the client ended its side (p may then be empty;
	// a request without a body gets one such call after ServeStream).
	// The bytes hold the stream's receive window until the handler calls
	// Consumed.
	Data(s *Stream, p []byte, end bool)
	// Sent reports that n more bytes queued with Write were written to
	// the connection (not after Closed).
	Sent(s *Stream, n int)
	// Closed is called once when the stream ends: err is nil when both
	// sides ended, a StreamResetError, or the connection's end.
	Closed(s *Stream, err error)
}

// Request is a stream's request headers.
type Request struct {
	Method, Scheme, Authority, Path string
	// Header has canonical keys; cookies joined as net/http does.
	Header http.Header
	// ContentLength is the declared length, or -1.
	ContentLength int64
	// TLS is the connection's state (nil without TLS).
	TLS        *tls.ConnectionState
	RemoteAddr string
}

// StreamResetError is a stream's end by RST_STREAM.
type StreamResetError struct {
	Code http2.ErrCode
	// Remote: the client reset it.
	Remote bool
}

func (e StreamResetError) Error() string {
	who := "server"
	if e.Remote {
		who = "client"
	}
	return fmt.Sprintf("h2server: stream reset by the %s: %v", who, e.Code)
}

// Errors of the Stream's methods.
var (
	ErrStreamClosed   = errors.New("h2server: stream closed")
	ErrQueueFull      = errors.New("h2server: stream's write queue full")
	ErrHeadersWritten = errors.New("h2server: headers already written")
	ErrNoHeaders      = errors.New("h2server: write before headers")
)

// Stream is one request stream. Its methods are safe from any goroutine.
type Stream struct {
	c   *conn
	id  uint32
	req *Request
	// The rest is under c.mu.
	h            StreamHandler
	sendWindow   int64
	recvWindow   int64
	recvUnacked  int64
	recvd        int64
	wantLen      int64
	remoteDone   bool
	localDone    bool // END_STREAM written
	wroteHeaders bool
	// out is the data waiting for window; nil when none.
	out      []byte
	outEnd   bool
	trailers []hpack.HeaderField
	ended    bool
	endErr   error
	// unreported counts written bytes not yet told to h.Sent;
	// closedReported whether h.Closed ran.
	unreported     int
	closedReported bool
	notified       bool
	stall          clock.Timer
	stallGen       uint64
}

func (c *conn) newStreamLocked(id uint32, req *Request, ended bool) *Stream {
	req.RemoteAddr = c.raw.RemoteAddr().String()
	s := &Stream{c: c, id: id, req: req, sendWindow: c.peerWindow, recvWindow: int64(c.cfg.InitialWindowSize),
		wantLen: req.ContentLength, remoteDone: ended}
	c.streams[id] = s
	c.disarmIdleLocked()
	return s
}

// ID is the stream's id.
func (s *Stream) ID() uint32 { return s.id }

// Request is the stream's request.
func (s *Stream) Request() *Request { return s.req }

// Go runs f on a goroutine the Server waits for (Shutdown, Close). Call
// it from a callback or from a goroutine started by Go.
func (s *Stream) Go(f func()) {
	s.c.srv.wg.Add(1)
	go func() {
		defer s.c.srv.wg.Done()
		f()
	}()
}

// WriteHeaders writes the response headers; end ends the stream.
func (s *Stream) WriteHeaders(status int, h http.Header, end bool) error {
	s.c.mu.Lock()
	defer s.c.unlock()
	if s.ended || s.localDone {
		return ErrStreamClosed
	}
	if s.wroteHeaders {
		return ErrHeadersWritten
	}
	return s.writeHeadersLocked(status, h, end)
}

func (s *Stream) writeHeadersLocked(status int, h http.Header, end bool) error {
	fields := make([]hpack.HeaderField, 0, 1+len(h))
	fields = append(fields, hpack.HeaderField{Name: ":status", Value: strconv.Itoa(status)})
	fields = appendFields(fields, h)
	s.wroteHeaders = true
	err := s.c.withWriter(func(w *writer) error { return s.c.encodeHeaders(w, s.id, end, fields) })
	if end {
		s.localDone = true
		s.maybeEndLocked()
	}
	return err
}

// appendFields appends h's fields, lower-cased, without the
// connection-specific ones and net/http's trailer-prefixed keys.
func appendFields(fields []hpack.HeaderField, h http.Header) []hpack.HeaderField {
	for k, vs := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			continue
		}
		lk := strings.ToLower(k)
		if connectionFields[lk] {
			continue
		}
		for _, v := range vs {
			fields = append(fields, hpack.HeaderField{Name: lk, Value: v})
		}
	}
	return fields
}

// Write queues p (copied if it must wait) as DATA and hands what the
// client's windows and the connection's write buffer allow now to the
// connection's flusher; the rest goes when the client opens its windows
// and the buffer drains. It never waits for flow control or for the
// network. Beyond MaxQueuedBytes waiting it returns ErrQueueFull and
// queues nothing. StreamHandler.Sent reports the bytes once written to
// the connection.
func (s *Stream) Write(p []byte) error {
	c := s.c
	c.mu.Lock()
	defer c.unlock()
	switch {
	case s.ended || s.localDone || s.outEnd:
		return ErrStreamClosed
	case !s.wroteHeaders:
		return ErrNoHeaders
	case len(p) == 0:
		return nil
	case len(s.out)+len(p) > c.cfg.MaxQueuedBytes+int(max(0, min(s.sendWindow, c.sendWindow, int64(c.cfg.MaxWriteBuffer-c.buffered)))):
		return ErrQueueFull
	}
	if len(s.out) == 0 {
		s.out = p // borrowed for the flush below, copied if any is left
		s.flushLocked()
		if len(s.out) > 0 {
			s.out = append([]byte(nil), s.out...)
		}
		return nil
	}
	s.out = append(s.out, p...)
	s.flushLocked()
	return nil
}

// End ends the stream's response once its queued data is written.
func (s *Stream) End() error { return s.finish(nil) }

// WriteTrailers ends the stream with trailers once its queued data is
// written.
func (s *Stream) WriteTrailers(h http.Header) error {
	return s.finish(appendFields(make([]hpack.HeaderField, 0, len(h)), h))
}

func (s *Stream) finish(trailers []hpack.HeaderField) error {
	c := s.c
	c.mu.Lock()
	defer c.unlock()
	if s.ended || s.localDone || s.outEnd {
		return ErrStreamClosed
	}
	if !s.wroteHeaders {
		return ErrNoHeaders
	}
	s.outEnd = true
	s.trailers = trailers
	s.flushLocked()
	return nil
}

// Reset ends the stream with RST_STREAM.
func (s *Stream) Reset(code http2.ErrCode) {
	s.c.mu.Lock()
	if !s.ended {
		s.c.resetLocked(s, code)
	}
	s.c.unlock()
}

// Consumed returns n bytes of the stream's receive window to the client
// (in batches of half the window).
func (s *Stream) Consumed(n int) {
	s.c.mu.Lock()
	s.consumeLocked(int64(n))
	s.c.mu.Unlock()
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
	_ = s.c.writeLocked(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(s.id, uint32(inc)) })
}

// Queued is how many bytes wait for the client's window or for room in
// the connection's write buffer (not those in the buffer: Sent tells
// when they are written).
func (s *Stream) Queued() int {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return len(s.out)
}

// flushLocked hands what the windows and the connection's write buffer
// allow of the queued data to the flusher, then the end of the stream
// once nothing waits.
func (s *Stream) flushLocked() {
	c := s.c
	if s.ended || s.localDone || len(s.out) == 0 && !s.outEnd {
		return
	}
	sent := 0
	err := c.withWriter(func(w *writer) error {
		for len(s.out) > 0 {
			n := int(min(int64(len(s.out)), s.sendWindow, c.sendWindow, int64(min(c.peerMaxFrame, maxFrameSize))))
			if n <= 0 {
				break
			}
			if c.buffered >= c.cfg.MaxWriteBuffer {
				c.dataWaits = true // the flusher comes back once it drained
				break
			}
			last := n == len(s.out) && s.outEnd && s.trailers == nil
			if err := w.fr.WriteData(s.id, last, s.out[:n]); err != nil {
				return err
			}
			c.noteSentLocked(s, n)
			s.out = s.out[n:]
			s.sendWindow -= int64(n)
			c.sendWindow -= int64(n)
			sent += n
			if last {
				s.localDone = true
			}
		}
		if len(s.out) > 0 || !s.outEnd || s.localDone {
			return nil
		}
		s.localDone = true
		if s.trailers != nil {
			return c.encodeHeaders(w, s.id, true, s.trailers)
		}
		return w.fr.WriteData(s.id, true, nil)
	})
	if len(s.out) == 0 {
		s.out = nil
	}
	switch {
	case err != nil:
		s.endLocked(errConnClosed)
	case len(s.out) == 0:
		s.stopStallLocked()
	case sent > 0 || s.stall == nil:
		s.armStallLocked()
	}
	s.maybeEndLocked()
}

// armStallLocked (re)starts the timer that resets the stream if its
// queued data makes no progress.
func (s *Stream) armStallLocked() {
	s.stopStallLocked()
	gen := s.stallGen
	c := s.c
	s.stall = c.arm(c.cfg.StreamStallTimeout, func() {
		c.mu.Lock()
		if !s.ended && s.stallGen == gen && len(s.out) > 0 {
			c.resetLocked(s, http2.ErrCodeCancel)
		}
		c.unlock()
	})
}

func (s *Stream) stopStallLocked() {
	if s.stall != nil {
		s.c.disarm(s.stall)
		s.stall = nil
	}
	s.stallGen++
}

// maybeEndLocked ends the stream once both sides have.
func (s *Stream) maybeEndLocked() {
	if s.remoteDone && s.localDone {
		s.endLocked(nil)
	}
}

// endLocked removes the stream; its handler hears of it at the next
// unlock.
func (s *Stream) endLocked(err error) {
	if s.ended {
		return
	}
	c := s.c
	s.ended, s.endErr = true, err
	s.out, s.trailers = nil, nil
	s.stopStallLocked()
	delete(c.streams, s.id)
	c.noteLocked(s)
	if len(c.streams) == 0 && !c.closed {
		if c.goingAway {
			c.closeAfterFlushLocked()
		} else {
			c.armIdleLocked()
		}
	}
}

// noteLocked marks s as having events for its handler.
func (c *conn) noteLocked(s *Stream) {
	if !s.notified {
		s.notified = true
		c.notify = append(c.notify, s)
	}
}

// unlock releases mu and then tells the handlers what happened to their
// streams meanwhile.
func (c *conn) unlock() {
	var calls []func()
	for _, s := range c.notify {
		s.notified = false
		h := s.h
		if h == nil {
			continue
		}
		if n := s.unreported; n > 0 {
			s.unreported = 0
			calls = append(calls, func() { h.Sent(s, n) })
		}
		if s.ended && !s.closedReported {
			s.closedReported = true
			err := s.endErr
			calls = append(calls, func() { h.Closed(s, err) })
		}
	}
	c.notify = nil
	c.mu.Unlock()
	for _, f := range calls {
		f()
	}
}
