package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/tasks"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// A gateway in the API's own process (better-compute serve with [gateway]
// listen, and dev): Options.LocalAPI is the API's agent handler, and the
// gateway's upstream clients call it in memory through localTransport
// instead of dialing the agent listener. Everything above the transport is
// the relay as it is over the network: the same connect clients build
// every upstream request afresh from the daemon's message, set the same
// Bc-Peer-* headers from the daemon's connection, and inject the same
// trace context; hedging has one replica, health checks and /readyz ask
// the API's /readyz through the same path.
//
// SECURITY: what binds each field the API reads on this path.
//   - That the caller is the gateway: over the network the agent listener
//     requires a client certificate from the serving CA (mTLS), and the
//     agent handler refuses a request without a verified chain. Here the
//     caller holds the handler value: server.Run hands it to the gateway
//     it builds and to nothing else, and no listener serves it, so no
//     one outside the process can reach it. r.TLS is nil.
//   - Bc-Peer-Addr: the daemon's TCP address on the gateway's listener
//     (r.RemoteAddr there), set by relayUnary and the session relay.
//   - Bc-Peer-Certificate: the leaf the daemon presented in its TLS
//     handshake with the gateway, unverified (the API matches it byte for
//     byte against node_certs and requires the node key's signature).
//   - Every other header: connect's own (content type, timeout, user
//     agent) and traceparent from the gateway's client span, which carries
//     no authority. A daemon's headers never reach the API: peerContext
//     drops its Bc-Peer-* headers and the upstream requests are built
//     fresh, so nothing a daemon sends is copied; this transport passes on
//     only what the relay's clients put in their request.
//   - r.RemoteAddr is localRemoteAddr (no connection; the API reads the
//     daemon's address from Bc-Peer-Addr), r.Proto is HTTP/2.0 (connect
//     serves bidi streams only over HTTP/2).

// LocalAPIURL is the upstream's name in logs and metric labels when the
// gateway relays in memory (never dialed).
const LocalAPIURL = "http://in-process"

// localWindow bounds the answer bytes written and not yet read, as the
// agent listener's HTTP/2 stream window does (MaxReceiveBufferPerStream):
// the API can write a command while the gateway is busy sending it a
// result, and a gateway that stops reading stops the API's writes.
const localWindow = 256 << 10

// localRemoteAddr is the RemoteAddr the API's handler sees on this path.
const localRemoteAddr = "127.0.0.1:0"

// errAborted is what the gateway's side reads when the API's handler
// panicked (net/http would reset the stream).
var errAborted = errors.New("the in-process API handler aborted the call")

// newLocalUpstream is the one upstream of a gateway in the API's process:
// joins, renewals, health checks and sessions all go through h in memory.
func (g *Gateway) newLocalUpstream(h http.Handler) *upstream {
	tr := localTransport{h: h, tasks: &g.tasks}
	u := &upstream{base: LocalAPIURL, tr: tr, raw: map[string]*connect.Client[rawMsg, rawMsg]{}, outC: make(chan struct{})}
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	u.http = &http.Client{Transport: tracing.Transport(g.tracer, tr), CheckRedirect: noRedirect}
	u.join = agentv1connect.NewJoinServiceClient(u.http, LocalAPIURL, g.upstreamOptions()...)
	for _, proc := range []string{agentv1connect.JoinServiceJoinProcedure, agentv1connect.JoinServiceRenewProcedure} {
		u.raw[proc] = connect.NewClient[rawMsg, rawMsg](u.http, LocalAPIURL+proc, g.upstreamOptions(connect.WithCodec(rawCodec{}))...)
	}
	// No connections to spread sessions over: one client carries them all.
	u.sessTrs = []roundTripper{tr}
	u.sessions = []agentv1connect.SessionServiceClient{agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr, CheckRedirect: noRedirect}, LocalAPIURL, g.upstreamOptions()...)}
	return u
}

// localTransport serves each request with h in memory, as an HTTP/2
// server would: the request and response bodies stream both ways at once
// (a session's stream; the answer through a buffer of localWindow, the
// request read by the handler as the gateway's client writes it: the
// API's session service reads its stream on a goroutine of its own),
// trailers arrive after the body, and the call ends
// for the handler (its context is cancelled, its body reads and writes
// fail) when the caller's context ends or it closes the response body
// early, as a stream reset would.
// The handler runs as one of the gateway's tasks: Shutdown waits for it.
type localTransport struct {
	h     http.Handler
	tasks *tasks.Tracker
}

// CloseIdleConnections: there are none.
func (localTransport) CloseIdleConnections() {}

func (t localTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	body := req.Body
	if body == nil {
		body = http.NoBody
	}
	ctx, cancel := context.WithCancel(req.Context())
	sr := (&http.Request{
		Method:        req.Method,
		URL:           &url.URL{Path: req.URL.Path, RawPath: req.URL.RawPath, RawQuery: req.URL.RawQuery},
		Proto:         "HTTP/2.0",
		ProtoMajor:    2,
		Header:        req.Header.Clone(),
		Body:          body,
		ContentLength: req.ContentLength,
		Host:          cmpOr(req.Host, req.URL.Host),
		RemoteAddr:    localRemoteAddr,
		RequestURI:    req.URL.RequestURI(),
	}).WithContext(ctx)
	if sr.Header == nil {
		sr.Header = http.Header{}
	}
	p := newBufPipe(localWindow)
	w := &localResponse{header: http.Header{}, p: p, ready: make(chan struct{}), res: &http.Response{
		Proto: "HTTP/2.0", ProtoMajor: 2, ContentLength: -1, Trailer: http.Header{}, Request: req,
	}}
	// The end of the call for the handler: its context ends (it stops
	// reading and writing) and its request body is closed, which unblocks
	// a read of a body still open (a session's).
	var once sync.Once
	end := func(err error) {
		once.Do(func() {
			cancel()
			_ = body.Close()
			p.closeRead(err)
		})
	}
	stop := context.AfterFunc(req.Context(), func() { end(req.Context().Err()) })
	w.res.Body = &localBody{p: p, ctx: req.Context(), end: func() { stop(); end(context.Canceled) }}
	if !t.tasks.Go(func() { t.serve(w, sr, cancel) }) {
		stop()
		end(errStopped)
		return nil, errStopped
	}
	select {
	case <-w.ready:
	case <-req.Context().Done():
		end(req.Context().Err())
		return nil, req.Context().Err()
	}
	if w.err != nil {
		stop()
		end(w.err)
		return nil, w.err
	}
	return w.res, nil
}

// serve runs the handler and ends the response: trailers, then the end of
// the body. The handler's context ends when it returns, as net/http's does.
func (t localTransport) serve(w *localResponse, r *http.Request, cancel context.CancelFunc) {
	defer func() {
		p := recover()
		cancel()
		// As net/http's server does once the handler returns; the
		// caller's writes to a stream's body fail from now on.
		_ = r.Body.Close()
		if p != nil {
			if !w.wrote {
				w.err = fmt.Errorf("%w: %v", errAborted, p)
				close(w.ready)
			}
			w.p.closeWrite(errAborted)
			return
		}
		w.finish()
	}()
	t.h.ServeHTTP(w, r)
}

// cmpOr is the first of a and b that is not empty.
func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// localResponse is the handler's http.ResponseWriter. Only the handler's
// goroutine touches header and wrote; the caller gets res once ready is
// closed, and res.Trailer once the body ends (the pipe orders both).
type localResponse struct {
	header   http.Header
	wrote    bool
	declared []string // the trailers named in the Trailer header
	p        *bufPipe
	res      *http.Response
	ready    chan struct{}
	err      error // the call failed before the headers (the handler panicked)
}

func (w *localResponse) Header() http.Header { return w.header }

// WriteHeader sends the status and a copy of the headers; later changes
// to the header map are trailers only (http.TrailerPrefix, or named in
// Trailer), as with net/http.
func (w *localResponse) WriteHeader(code int) {
	if w.wrote || (code >= 100 && code < 200) {
		return
	}
	w.wrote = true
	h := make(http.Header, len(w.header))
	for k, v := range w.header {
		switch {
		case k == "Trailer":
			for _, vv := range v {
				for name := range strings.SplitSeq(vv, ",") {
					if name = strings.TrimSpace(name); name != "" {
						w.declared = append(w.declared, http.CanonicalHeaderKey(name))
					}
				}
			}
		case strings.HasPrefix(k, http.TrailerPrefix):
		default:
			h[k] = slices.Clone(v)
		}
	}
	w.res.StatusCode = code
	w.res.Status = fmt.Sprintf("%d %s", code, http.StatusText(code))
	w.res.Header = h
	close(w.ready)
}

// Write streams b to the caller; it blocks while localWindow bytes wait
// for the caller, and fails once the call ended.
func (w *localResponse) Write(b []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return w.p.Write(b)
}

// Flush sends the headers; written data is readable at once.
func (w *localResponse) Flush() { w.WriteHeader(http.StatusOK) }

// EnableFullDuplex: the request body can always be read while the
// response is written.
func (w *localResponse) EnableFullDuplex() error { return nil }

// finish sends the headers if the handler wrote nothing, then the
// trailers and the end of the body.
func (w *localResponse) finish() {
	w.WriteHeader(http.StatusOK)
	// The trailers are set under the pipe's lock, and only while the
	// caller has not seen the body end: a caller that saw an error (it
	// reset the stream) may be reading res.Trailer already, and one that
	// reads io.EOF does so after this.
	w.p.closeWriteWith(io.EOF, func() {
		for k, v := range w.header {
			if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
				w.res.Trailer[http.CanonicalHeaderKey(name)] = slices.Clone(v)
			}
		}
		for _, k := range w.declared {
			if v, ok := w.header[k]; ok {
				w.res.Trailer[k] = slices.Clone(v)
			}
		}
	})
}

// localBody is the response body the gateway reads. Closing it before its
// end ends the call for the handler, as a stream reset does.
type localBody struct {
	p   *bufPipe
	ctx context.Context
	end func()
}

func (b *localBody) Read(p []byte) (int, error) {
	n, err := b.p.Read(p)
	if err != nil && !errors.Is(err, io.EOF) && b.ctx.Err() != nil {
		err = b.ctx.Err()
	}
	return n, err
}

func (b *localBody) Close() error {
	b.end()
	return nil
}

// bufPipe is an in-memory pipe holding up to max bytes: writes block while
// it is full, reads while it is empty. Either side's close ends it: after
// closeRead, reads and writes fail with its error; after closeWrite, reads
// drain what is left, then return its error (io.EOF for a normal end).
type bufPipe struct {
	mu   sync.Mutex
	cond sync.Cond
	buf  []byte
	off  int // buf[off:] is unread
	max  int
	rerr error // the read side closed
	werr error // the write side closed
}

func newBufPipe(max int) *bufPipe {
	p := &bufPipe{max: max}
	p.cond.L = &p.mu
	return p
}

func (p *bufPipe) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for len(b) > 0 {
		for p.rerr == nil && p.werr == nil && len(p.buf)-p.off >= p.max {
			p.cond.Wait()
		}
		switch {
		case p.rerr != nil:
			return n, p.rerr
		case p.werr != nil:
			return n, io.ErrClosedPipe
		}
		if p.off > 0 && p.off == len(p.buf) {
			p.buf, p.off = p.buf[:0], 0
		}
		k := min(len(b), p.max-(len(p.buf)-p.off))
		p.buf = append(p.buf, b[:k]...)
		b, n = b[k:], n+k
		p.cond.Broadcast()
	}
	return n, nil
}

func (p *bufPipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.rerr == nil && p.werr == nil && p.off == len(p.buf) {
		p.cond.Wait()
	}
	switch {
	case p.rerr != nil:
		return 0, p.rerr
	case p.off == len(p.buf):
		return 0, p.werr
	}
	n := copy(b, p.buf[p.off:])
	p.off += n
	if p.off == len(p.buf) {
		// Drained: an idle stream keeps no buffer.
		p.buf, p.off = nil, 0
	}
	p.cond.Broadcast()
	return n, nil
}

func (p *bufPipe) closeRead(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rerr == nil {
		p.rerr = err
		p.buf, p.off = nil, 0
	}
	p.cond.Broadcast()
}

func (p *bufPipe) closeWrite(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.werr == nil {
		p.werr = err
	}
	p.cond.Broadcast()
}

// closeWriteWith is closeWrite that first runs fn, under the pipe's lock,
// when neither side has closed yet: what fn writes is seen by a reader
// that reads err, and never written while a reader that already saw the
// end may read it.
func (p *bufPipe) closeWriteWith(err error, fn func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.werr == nil && p.rerr == nil {
		fn()
	}
	if p.werr == nil {
		p.werr = err
	}
	p.cond.Broadcast()
}
