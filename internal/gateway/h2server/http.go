package h2server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"

	"golang.org/x/net/http2"
)

// HTTP serves every stream with h, on a goroutine of its own while h
// runs: the request's headers and body in; headers, data and trailers
// out, as net/http's HTTP/2 server does (trailers named in a "Trailer"
// header or set with http.TrailerPrefix keys). A Write waits until the
// client's window took what it wrote; the body's bytes go back to the
// client's window as h reads them.
func HTTP(h http.Handler) Handler { return httpHandler{h} }

type httpHandler struct{ h http.Handler }

func (a httpHandler) ServeStream(s *Stream) StreamHandler {
	hs := &httpStream{s: s, hdr: make(http.Header), status: http.StatusOK}
	hs.cond.L = &hs.mu
	hs.bodyEnd = s.RequestEnded()
	if d := s.c.cfg.ReadTimeout; d > 0 && !hs.bodyEnd {
		hs.mu.Lock()
		hs.armReadLocked(d)
		hs.mu.Unlock()
	}
	s.Go(func() { hs.run(a.h) })
	return hs
}

// httpStream is one stream under an http.Handler: its request body, its
// http.ResponseWriter and its StreamHandler.
type httpStream struct {
	s *Stream

	mu   sync.Mutex
	cond sync.Cond // body data, the end, bytes sent, the stream's end
	// body is what arrived and was not read yet.
	body       []byte
	bodyEnd    bool
	bodyClosed bool
	ended      bool
	endErr     error
	cancel     context.CancelFunc
	// readTimer is the body's deadline (Config.ReadTimeout), readGen
	// tells a superseded one; readTimedOut is set once it passed.
	readTimer    clock.Timer
	readGen      int
	readTimedOut bool

	// the response, the handler's goroutine's alone
	hdr         http.Header
	status      int
	wroteHeader bool // WriteHeader called
	sentHeader  bool // the HEADERS frame is out
	declared    []string
}

// RequestEnded reports whether the client ended its side.
func (s *Stream) RequestEnded() bool {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.remoteDone
}

func (hs *httpStream) Data(_ *Stream, p []byte, end bool) {
	hs.mu.Lock()
	if hs.bodyClosed {
		hs.s.Consumed(len(p))
	} else {
		hs.body = append(hs.body, p...)
	}
	hs.bodyEnd = hs.bodyEnd || end
	if hs.bodyEnd {
		hs.disarmReadLocked()
	}
	hs.mu.Unlock()
	hs.cond.Broadcast()
}

// armReadLocked (re)starts the body's deadline, d from now.
func (hs *httpStream) armReadLocked(d time.Duration) {
	hs.disarmReadLocked()
	gen := hs.readGen
	hs.readTimer = hs.s.c.arm(d, func() {
		hs.mu.Lock()
		late := gen == hs.readGen && !hs.bodyEnd && !hs.ended && !hs.bodyClosed
		if late {
			hs.readTimedOut = true
			hs.readTimer = nil
		}
		hs.mu.Unlock()
		if late {
			// The reset ends the stream (Closed), which wakes a read:
			// the handler cannot end the stream first.
			hs.s.Reset(http2.ErrCodeCancel)
		}
	})
}

func (hs *httpStream) disarmReadLocked() {
	if hs.readTimer != nil {
		hs.s.c.disarm(hs.readTimer)
		hs.readTimer = nil
	}
	hs.readGen++
}

// SetReadDeadline moves the body's deadline (http.ResponseController);
// the zero time lifts it.
func (hs *httpStream) SetReadDeadline(t time.Time) error {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	hs.disarmReadLocked()
	if !t.IsZero() && !hs.bodyEnd && !hs.ended && !hs.readTimedOut {
		hs.armReadLocked(max(t.Sub(hs.s.c.clock.Now()), 0))
	}
	return nil
}

// Sent wakes a Write waiting for its bytes to leave. Under mu: a Write
// that found bytes queued is then in cond.Wait, not about to enter it.
func (hs *httpStream) Sent(*Stream, int) {
	hs.mu.Lock()
	hs.cond.Broadcast()
	hs.mu.Unlock()
}

func (hs *httpStream) Closed(_ *Stream, err error) {
	hs.mu.Lock()
	hs.ended, hs.endErr = true, err
	hs.disarmReadLocked()
	cancel := hs.cancel
	hs.mu.Unlock()
	hs.cond.Broadcast()
	if cancel != nil && err != nil {
		cancel()
	}
}

// run serves the stream with h and ends it.
func (hs *httpStream) run(h http.Handler) {
	req := hs.s.Request()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hs.mu.Lock()
	hs.cancel = cancel
	if hs.ended && hs.endErr != nil {
		cancel()
	}
	hs.mu.Unlock()
	u, err := url.ParseRequestURI(req.Path)
	if err != nil {
		_ = hs.s.WriteHeaders(http.StatusBadRequest, nil, true)
		hs.s.Reset(http2.ErrCodeNo)
		return
	}
	host := req.Authority
	if host == "" {
		host = req.Header.Get("Host")
	}
	r := (&http.Request{
		Method: req.Method, URL: u, Proto: "HTTP/2.0", ProtoMajor: 2, Header: req.Header,
		Host: host, RemoteAddr: req.RemoteAddr, RequestURI: req.Path, TLS: req.TLS,
		ContentLength: req.ContentLength, Body: (*httpBody)(hs),
	}).WithContext(ctx)
	hs.mu.Lock()
	if hs.bodyEnd && len(hs.body) == 0 {
		r.Body, r.ContentLength = http.NoBody, 0
	}
	hs.mu.Unlock()
	if !hs.serve(h, r) {
		hs.s.Reset(http2.ErrCodeInternal)
		return
	}
	hs.end()
}

// serve calls h, and reports false if it panicked (logged).
func (hs *httpStream) serve(h http.Handler, r *http.Request) (ok bool) {
	defer func() {
		if v := recover(); v != nil && v != http.ErrAbortHandler {
			hs.s.c.cfg.Log.Error("h2server: handler panicked", "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
		}
	}()
	h.ServeHTTP(hs, r)
	return true
}

// end writes what the handler left unsaid: the headers, the trailers or
// the end of the stream, and resets a stream whose request is still
// coming.
func (hs *httpStream) end() {
	tr := hs.trailers()
	switch {
	case !hs.sentHeader && len(tr) == 0:
		hs.sentHeader = true
		_ = hs.s.WriteHeaders(hs.status, hs.hdr, true)
	case len(tr) > 0:
		hs.sendHeader()
		_ = hs.s.WriteTrailers(tr)
	default:
		_ = hs.s.End()
	}
	if !hs.s.RequestEnded() {
		hs.s.Reset(http2.ErrCodeNo)
	}
	hs.mu.Lock()
	hs.bodyClosed = true
	hs.disarmReadLocked()
	n := len(hs.body)
	hs.body = nil
	hs.mu.Unlock()
	hs.s.Consumed(n)
}

// trailers collects the handler's trailers: the declared keys and the
// TrailerPrefix ones.
func (hs *httpStream) trailers() http.Header {
	var tr http.Header
	add := func(k string, vs []string) {
		if tr == nil {
			tr = make(http.Header)
		}
		tr[http.CanonicalHeaderKey(k)] = vs
	}
	for _, k := range hs.declared {
		if vs := hs.hdr[k]; len(vs) > 0 {
			add(k, vs)
		}
	}
	for k, vs := range hs.hdr {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			add(strings.TrimPrefix(k, http.TrailerPrefix), vs)
		}
	}
	return tr
}

func (hs *httpStream) Header() http.Header { return hs.hdr }

func (hs *httpStream) WriteHeader(code int) {
	if hs.wroteHeader || code < 200 {
		return // informational answers are not sent
	}
	hs.wroteHeader = true
	hs.status = code
	for _, v := range hs.hdr["Trailer"] {
		for k := range strings.SplitSeq(v, ",") {
			if k = http.CanonicalHeaderKey(strings.TrimSpace(k)); k != "" {
				hs.declared = append(hs.declared, k)
			}
		}
	}
}

func (hs *httpStream) sendHeader() {
	if !hs.wroteHeader {
		hs.WriteHeader(http.StatusOK)
	}
	if hs.sentHeader {
		return
	}
	hs.sentHeader = true
	h := hs.hdr
	if len(hs.declared) > 0 {
		h = hs.hdr.Clone()
		for _, k := range hs.declared {
			delete(h, k)
		}
	}
	_ = hs.s.WriteHeaders(hs.status, h, false)
}

// Write writes p and waits until the client's window took it.
func (hs *httpStream) Write(p []byte) (int, error) {
	hs.sendHeader()
	written := 0
	for len(p) > 0 {
		n := min(len(p), maxFrameSize)
		if err := hs.s.Write(p[:n]); err != nil {
			return written, err
		}
		p = p[n:]
		written += n
		hs.mu.Lock()
		for !hs.ended && hs.s.Queued() > 0 {
			hs.cond.Wait()
		}
		ended, err := hs.ended, hs.endErr
		hs.mu.Unlock()
		if ended && err != nil {
			return written, err
		}
	}
	return written, nil
}

// Flush sends the headers if they are not out yet (Write sends at once).
func (hs *httpStream) Flush() { hs.sendHeader() }

// errReadTimeout is a body read past Config.ReadTimeout.
var errReadTimeout = fmt.Errorf("h2server: request body: %w", os.ErrDeadlineExceeded)

// httpBody is the request body.
type httpBody httpStream

func (b *httpBody) Read(p []byte) (int, error) {
	hs := (*httpStream)(b)
	hs.mu.Lock()
	for len(hs.body) == 0 && !hs.bodyEnd && !hs.ended && !hs.bodyClosed {
		hs.cond.Wait()
	}
	if len(hs.body) > 0 {
		n := copy(p, hs.body)
		hs.body = hs.body[n:]
		if len(hs.body) == 0 {
			hs.body = nil
		}
		hs.mu.Unlock()
		hs.s.Consumed(n)
		return n, nil
	}
	defer hs.mu.Unlock()
	if hs.bodyEnd {
		return 0, io.EOF
	}
	if hs.bodyClosed {
		return 0, http.ErrBodyReadAfterClose
	}
	if hs.readTimedOut {
		return 0, errReadTimeout
	}
	if hs.endErr != nil {
		return 0, hs.endErr
	}
	return 0, io.ErrUnexpectedEOF
}

func (b *httpBody) Close() error {
	hs := (*httpStream)(b)
	hs.mu.Lock()
	hs.bodyClosed = true
	n := len(hs.body)
	hs.body = nil
	hs.mu.Unlock()
	hs.cond.Broadcast()
	hs.s.Consumed(n)
	return nil
}

var _ http.Flusher = (*httpStream)(nil)
