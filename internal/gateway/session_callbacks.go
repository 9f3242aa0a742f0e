package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/gateway/grpcmsg"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/gateway/h2upstream"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Sessions relayed on callbacks (session_relay = "callbacks", with
// daemon_http2 = "framer"). A daemon's SessionService.Connect stream
// (gRPC, what bcd speaks) is served by an h2server StreamHandler, not by
// the http.Handler: each session is relayed to an h2upstream stream on the
// picked replica, message by message, from the two connections'
// goroutines. A held session is a callbackSession, an h2server.Stream and
// an h2upstream.Stream: no goroutine and no buffer while it is idle. The
// behaviour is session.go's (read it for the why):
//   - no client certificate: ACCESS_DENIED "Session refused"; past
//     max_sessions: RESOURCE_EXHAUSTED and the "gateway full" line;
//   - the upstream stream opens at once (the API speaks first), with
//     Bc-Peer-Addr and Bc-Peer-Certificate;
//   - messages are bounded by max_body_bytes both ways; commands whose
//     kind Welcome did not allow are not relayed, the API gets the
//     gateway's unsigned refusal instead (R7.5);
//   - the API's end (its status, a refusal) goes to the daemon as it is;
//     a failure of the upstream is UNAVAILABLE (and a relay error, the
//     replica marked out when the stream could not be opened); Shutdown
//     ends every session with UNAVAILABLE "the gateway is shutting down;
//     reconnect"; the daemon's END_STREAM ends the upstream request, the
//     daemon gone resets the upstream stream;
//   - traced as tracing.Handler and tracing.Transport trace the relay
//     on net/http: a server span for the daemon's stream (a child of its
//     traceparent), ended when the session is released, and under it a
//     client span for the upstream stream, whose context goes upstream
//     as traceparent and which ends with the API's response headers.
//
// Flow control: a message's bytes go back to the window of the side that
// sent it only once the other side has written all that was queued to it
// (Sent, OnSent), so a slow daemon or a slow API holds the other side to
// a stream window (about 64 KiB) instead of a buffer growing at the
// gateway. Writes on either side only queue frames (each connection's
// flusher writes them, and Sent and OnSent report bytes once their socket
// took them), so neither connection's reader waits on the other's
// network: a daemon that stops reading its socket holds its own session
// back, not the upstream connection's other sessions. Errors are encoded as connect's handler encodes them for a gRPC
// client: grpc-status, grpc-message (percent-encoded) and
// grpc-status-details-bin (a google.rpc.Status with the product code's
// ErrorDetail); a refusal before anything else is a trailers-only
// answer.

// grpcResponseHeader is a session answer's headers.
var grpcResponseHeader = http.Header{"Content-Type": {"application/grpc"}}

// Errors that end a session from the daemon's side.
var (
	errCompressedMessage = errors.New("compressed gRPC message without grpc-encoding")
	errTruncatedMessage  = errors.New("the daemon ended its stream inside a message")
)

// framerHandler is h2server's handler: every stream through the
// gateway's http.Handler, except, with session_relay = "callbacks", the
// gRPC SessionService.Connect streams.
func (g *Gateway) framerHandler() h2server.Handler {
	httpH := h2server.HTTP(g.handler)
	if g.cfg.SessionRelay != SessionRelayCallbacks {
		return httpH
	}
	return h2server.HandlerFunc(func(s *h2server.Stream) h2server.StreamHandler {
		r := s.Request()
		if r.Method == http.MethodPost && r.Path == agentv1connect.SessionServiceConnectProcedure && grpcProto(r.Header.Get("Content-Type")) {
			return g.serveSession(s)
		}
		return httpH.ServeStream(s)
	})
}

// grpcProto reports whether a content type is gRPC with the binary
// codec (the Connect and gRPC-Web protocols and JSON stay with connect's
// handler).
func grpcProto(contentType string) bool {
	ct, _, _ := strings.Cut(contentType, ";")
	switch strings.ToLower(strings.TrimSpace(ct)) {
	case "application/grpc", "application/grpc+proto":
		return true
	}
	return false
}

// newSessionClient gives u its h2upstream client (session_relay =
// "callbacks"): upstream_conns connections with tlsCfg, the same as the
// transports'.
func (g *Gateway) newSessionClient(u *upstream, tlsCfg *tls.Config) error {
	pu, err := url.Parse(u.base)
	if err != nil {
		return badKey("api_url", "%v", err)
	}
	addr := pu.Host
	if pu.Port() == "" {
		addr = net.JoinHostPort(pu.Hostname(), "443")
	}
	u.sessionPath = strings.TrimSuffix(pu.Path, "/") + agentv1connect.SessionServiceConnectProcedure
	u.h2, err = h2upstream.New(h2upstream.Config{
		Addr:           addr,
		TLS:            tlsCfg,
		Dial:           upstreamDialer.DialContext,
		Clock:          g.clock,
		Log:            g.log,
		Conns:          g.cfg.UpstreamConns,
		MaxMessageSize: g.cfg.MaxBodyBytes,
	})
	if err != nil {
		return badKey("api_url", "%v", err)
	}
	return nil
}

// callbackSession is one session relayed on callbacks: the daemon's
// StreamHandler and the upstream stream's Handler.
type callbackSession struct {
	g     *Gateway
	d     *h2server.Stream
	u     *upstream
	addr  string
	start time.Time
	// span is the daemon stream's server span (no-op when tracing is
	// off), ended on release.
	span trace.Span

	// in cuts the daemon's DATA into messages; feedMu serializes feeding
	// (Data on the daemon connection's goroutine, and the replay of what
	// came before the upstream stream was open).
	feedMu sync.Mutex
	in     grpcmsg.Messages

	mu sync.Mutex
	// cert is the daemon's leaf until the upstream stream is opened.
	cert []byte
	up   *h2upstream.Stream
	// ready: the upstream stream is open and early was replayed; early
	// is what the daemon sent before (at most its stream window).
	ready      bool
	early      []byte
	earlyEnd   bool
	openCancel context.CancelFunc
	stopWatch  func() bool
	// upSpan is the upstream stream's client span until it ends (the
	// API's headers came, or the stream ended without them).
	upSpan trace.Span
	// Flow control. upUnsent: bytes queued upstream not yet written;
	// upOwed and apiOwed: the daemon's and the API's window to return
	// once they are. downUnsent and downOwed: the same toward the daemon.
	upUnsent, upOwed, apiOwed int
	downUnsent, downOwed      int
	// Welcome's, for the command-kind check.
	welcomed bool
	allowed  []string
	nodeID   string
	// answered: the daemon's trailers are decided (once), trailed: and
	// queued; gone: the daemon's stream ended first; closing: the relay
	// ends the upstream stream itself (its end is no failure).
	answered, trailed, gone, closing bool
	// dDone, upDone: each stream has ended; stopping: shutdown runs;
	// released: the session's slot and task are given back.
	dDone, upDone, stopping, released bool
}

// serveSession starts relaying the daemon's stream d, or refuses it.
// It runs on the daemon connection's goroutine and does not block: the
// upstream stream is opened on a goroutine of the gateway's tasks, which
// ends once it is open.
func (g *Gateway) serveSession(d *h2server.Stream) h2server.StreamHandler {
	r := d.Request()
	proc := agentv1connect.SessionServiceConnectProcedure
	// The server span tracing.Handler gives the net/http relay, from the
	// daemon's traceparent (read before the headers are dropped).
	ctx, span := tracing.StartServer(context.Background(), g.tracer, r.Method, r.Path, r.Header)
	if enc := r.Header.Get("Grpc-Encoding"); enc != "" && enc != "identity" {
		// SECURITY: no compression (noCompression), refused before a
		// byte of the body is read.
		refuseStream(d, wire.GRPCTrailers(connect.NewError(connect.CodeUnimplemented, fmt.Errorf("compression %q is not supported", enc))))
		span.End()
		return nil
	}
	var cert []byte
	if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
		cert = r.TLS.PeerCertificates[0].Raw
	}
	if len(cert) == 0 {
		refuseStream(d, wire.GRPCTrailers(wire.ToWireContext(ctx, g.log, proc, errs.New(errs.AccessDenied, "Session refused"))))
		span.End()
		return nil
	}
	if g.stopped.Err() != nil || !g.tasks.Enter() {
		refuseStream(d, shutdownTrailers(g))
		span.End()
		return nil
	}
	select {
	case g.held <- struct{}{}:
	default:
		g.tasks.Leave()
		g.lines.LogContext(ctx, slog.LevelWarn, "full", "gateway full: session refused", telemetry.LogPeer, r.RemoteAddr, "max_sessions", g.cfg.MaxSessions)
		refuseStream(d, wire.GRPCTrailers(wire.ToWireContext(ctx, g.log, proc, errs.New(errs.ResourcesLimited, "the gateway is busy; retry later"))))
		span.End()
		return nil
	}
	// Read: a held session keeps none of its request's headers (h2server
	// keeps the Request for the stream's life).
	r.Header = nil
	s := &callbackSession{g: g, d: d, addr: r.RemoteAddr, start: g.clock.Now(), cert: cert, span: span}
	s.in.Max = g.cfg.MaxBodyBytes
	// A new session goes to a healthy replica; one whose replica dies
	// ends, and bcd reconnects (to another replica through pick).
	s.u = g.pick(nil)
	// The headers now: every later end is trailers.
	_ = d.WriteHeaders(http.StatusOK, grpcResponseHeader, false)
	s.mu.Lock()
	s.stopWatch = context.AfterFunc(g.stopped, s.shutdown)
	s.mu.Unlock()
	if !g.tasks.Go(s.open) {
		s.mu.Lock()
		s.upDone = true
		s.mu.Unlock()
		s.shutdown()
	}
	return s
}

// refuseStream answers d with trailers only and resets its request if it
// is still coming, as net/http does after a handler's answer.
func refuseStream(d *h2server.Stream, tr http.Header) {
	h := make(http.Header, len(tr)+1)
	for k, v := range grpcResponseHeader {
		h[k] = v
	}
	for k, v := range tr {
		h[k] = v
	}
	_ = d.WriteHeaders(http.StatusOK, h, true)
	if !d.RequestEnded() {
		d.Reset(http2.ErrCodeNo)
	}
}

// open opens the upstream stream (the API speaks first) and replays what
// the daemon sent meanwhile.
func (s *callbackSession) open() {
	g := s.g
	ctx, cancel := context.WithCancel(g.stopped)
	defer cancel()
	s.mu.Lock()
	if s.answered || s.gone {
		s.upDone = true
		s.mu.Unlock()
		s.release()
		return
	}
	s.openCancel = cancel
	cert := s.cert
	s.cert = nil
	s.mu.Unlock()
	h := make(http.Header, 3)
	h.Set(wire.PeerAddrHeader, s.addr)
	wire.SetPeerCertificate(h, cert)
	// The client span tracing.Transport gives the net/http relay's
	// upstream request; its traceparent goes in h.
	upSpan := tracing.StartClient(s.spanContext(), g.tracer, http.MethodPost, s.u.sessionPath, h)
	s.mu.Lock()
	s.upSpan = upSpan
	s.mu.Unlock()
	up, err := s.u.h2.Open(ctx, h2upstream.Request{Path: s.u.sessionPath, Header: h}, s)
	s.mu.Lock()
	s.openCancel = nil
	if err != nil {
		s.upDone = true
		quiet := s.answered || s.gone
		s.mu.Unlock()
		s.endUpSpan(0)
		switch {
		case g.stopped.Err() != nil:
			s.answer(shutdownTrailers(g))
		case !quiet:
			g.relayError(s.u)
			g.markDown(s.u, err)
			s.answer(s.failure(err))
		}
		s.release()
		return
	}
	s.up = up
	over := s.answered || s.gone || s.upDone
	s.mu.Unlock()
	if over {
		up.Reset() // no-op if it ended already
		return
	}
	g.metrics.opened.Inc()
	s.feedMu.Lock()
	defer s.feedMu.Unlock()
	s.mu.Lock()
	s.ready = true
	early, end := s.early, s.earlyEnd
	s.early = nil
	s.mu.Unlock()
	if len(early) > 0 || end {
		s.feed(up, early, end)
	}
}

// Data takes the daemon's bytes: its messages go upstream.
func (s *callbackSession) Data(d *h2server.Stream, p []byte, end bool) {
	s.feedMu.Lock()
	defer s.feedMu.Unlock()
	s.mu.Lock()
	switch {
	case s.answered || s.closing:
		s.mu.Unlock()
		d.Consumed(len(p))
		return
	case !s.ready:
		s.early = append(s.early, p...)
		s.earlyEnd = s.earlyEnd || end
		s.mu.Unlock()
		return
	}
	up := s.up
	s.mu.Unlock()
	s.feed(up, p, end)
}

// feed cuts p into messages and sends each upstream; the daemon's END_STREAM
// ends the upstream request. The caller holds feedMu.
func (s *callbackSession) feed(up *h2upstream.Stream, p []byte, end bool) {
	held, err := s.in.Feed(p, func(flags byte, msg []byte, window int) error {
		if flags != 0 {
			return errCompressedMessage
		}
		s.mu.Lock()
		s.upUnsent += 5 + len(msg)
		s.upOwed += window
		s.mu.Unlock()
		return up.Send(msg)
	})
	if err == nil && end && s.in.Partial() {
		err = errTruncatedMessage
	}
	switch {
	case errors.Is(err, grpcmsg.ErrTooLarge):
		s.answer(wire.GRPCTrailers(wire.ToWire(s.g.log, agentv1connect.SessionServiceConnectProcedure,
			errs.New(errs.ResourcesLimited, "a session message is over the gateway's limit of %d bytes", s.g.cfg.MaxBodyBytes))))
		return
	case errors.Is(err, errCompressedMessage), errors.Is(err, errTruncatedMessage):
		s.answer(wire.GRPCTrailers(connect.NewError(connect.CodeInternal, err)))
		return
	case errors.Is(err, h2upstream.ErrQueueFull):
		s.g.relayError(s.u)
		s.answer(s.failure(err))
		return
	case err != nil:
		return // the upstream stream ended: its end tells the daemon
	}
	s.d.Consumed(held)
	if end {
		_ = up.CloseSend()
	}
}

// Sent returns the API's window once the daemon took all that was
// queued to it, and resets the daemon's request once its answer is out.
func (s *callbackSession) Sent(_ *h2server.Stream, n int) {
	s.mu.Lock()
	s.downUnsent -= n
	owed := 0
	if s.downUnsent <= 0 {
		s.downUnsent = 0
		owed, s.downOwed = s.downOwed, 0
	}
	up, trailed := s.up, s.trailed
	s.mu.Unlock()
	if owed > 0 && up != nil {
		up.Consumed(owed)
	}
	if trailed {
		s.resetRequest()
	}
}

// Closed: the daemon's stream ended. Gone before its answer (a reset, its
// connection lost), it takes the upstream stream with it.
func (s *callbackSession) Closed(_ *h2server.Stream, err error) {
	s.mu.Lock()
	s.dDone = true
	if err != nil || !s.answered {
		s.gone = true
	}
	s.mu.Unlock()
	s.endUp()
	s.release()
}

// OnHeaders notes the upstream stream (its messages may come before Open
// returns).
func (s *callbackSession) OnHeaders(up *h2upstream.Stream, _ http.Header) {
	s.mu.Lock()
	if s.up == nil {
		s.up = up
	}
	s.mu.Unlock()
	s.endUpSpan(http.StatusOK) // h2upstream hands over 200s only
}

// endUpSpan ends the upstream stream's client span (once) with the
// response's HTTP status, or 0: it failed before its headers.
func (s *callbackSession) endUpSpan(status int) {
	s.mu.Lock()
	span := s.upSpan
	s.upSpan = nil
	s.mu.Unlock()
	if span != nil {
		tracing.EndClient(span, status)
	}
}

// spanContext is a context of the session's server span, for the spans
// and log lines of the session.
func (s *callbackSession) spanContext() context.Context {
	return trace.ContextWithSpan(context.Background(), s.span)
}

// OnMessage relays one of the API's messages to the daemon, after the
// command-kind check (session.go's).
func (s *callbackSession) OnMessage(up *h2upstream.Stream, msg []byte, window int) {
	var m agentv1.SessionServerMessage
	if err := proto.Unmarshal(msg, &m); err != nil {
		s.g.relayError(s.u)
		s.answer(s.failure(fmt.Errorf("the API's message does not parse: %w", err)))
		return
	}
	switch v := m.GetMsg().(type) {
	case *agentv1.SessionServerMessage_Welcome:
		s.mu.Lock()
		if !s.welcomed {
			s.welcomed = true
			s.allowed = v.Welcome.GetAllowedKinds()
			s.nodeID = v.Welcome.GetNodeId()
		}
		s.mu.Unlock()
	case *agentv1.SessionServerMessage_Command:
		s.mu.Lock()
		allowed, nodeID := s.allowed, s.nodeID
		s.mu.Unlock()
		if id, kind, ok := s.g.commandAllowed(allowed, v.Command); !ok {
			s.g.log.Warn("command refused at the gateway: kind not allowed by the node certificate",
				telemetry.LogNodeID, nodeID, telemetry.LogPeer, s.addr, telemetry.LogCommand, id, telemetry.LogKind, kind, "allowed_kinds", strings.Join(allowed, ","))
			s.refuseCommand(up, id, window)
			return
		}
	}
	b := grpcmsg.Append(make([]byte, 0, 5+len(msg)), 0, msg)
	s.mu.Lock()
	s.downUnsent += len(b)
	s.downOwed += window
	s.mu.Unlock()
	if err := s.d.Write(b); errors.Is(err, h2server.ErrQueueFull) {
		s.answer(wire.GRPCTrailers(wire.ToWire(s.g.log, agentv1connect.SessionServiceConnectProcedure,
			errs.New(errs.Unavailable, "the session fell behind; reconnect"))))
	}
	// Any other error: the daemon's stream ended, Closed follows.
}

// refuseCommand answers the API for a command the gateway does not
// relay with the unsigned refusal; the command's window goes back once
// the refusal is written.
func (s *callbackSession) refuseCommand(up *h2upstream.Stream, id string, window int) {
	if id == "" {
		up.Consumed(window)
		return
	}
	b, err := proto.Marshal(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: &agentv1.CommandResult{
		CommandId: id, Ok: false, Error: wire.GatewayKindRefused}}})
	if err != nil {
		up.Consumed(window)
		return
	}
	s.mu.Lock()
	s.upUnsent += 5 + len(b)
	s.apiOwed += window
	s.mu.Unlock()
	_ = up.Send(b) // failing, the upstream stream ended: its end follows
}

// OnSent returns the daemon's window (and the API's, for refused
// commands) once the API took all that was queued to it.
func (s *callbackSession) OnSent(up *h2upstream.Stream, n int) {
	s.mu.Lock()
	s.upUnsent -= n
	owedD, owedA := 0, 0
	if s.upUnsent <= 0 {
		s.upUnsent = 0
		owedD, owedA = s.upOwed, s.apiOwed
		s.upOwed, s.apiOwed = 0, 0
	}
	s.mu.Unlock()
	if owedD > 0 {
		s.d.Consumed(owedD)
	}
	if owedA > 0 {
		up.Consumed(owedA)
	}
}

// OnTrailers: the API ended the stream with a status.
func (s *callbackSession) OnTrailers(_ *h2upstream.Stream, st h2upstream.Status) {
	s.upEnded(nil, &st)
}

// OnReset: the upstream stream ended without a status.
func (s *callbackSession) OnReset(_ *h2upstream.Stream, err error) { s.upEnded(err, nil) }

// upEnded tells the daemon how the upstream stream ended: the API's
// answer as it is, or, when the upstream failed, UNAVAILABLE.
func (s *callbackSession) upEnded(err error, st *h2upstream.Status) {
	g := s.g
	if st != nil && apiAnswered(*st) {
		s.endUpSpan(http.StatusOK) // a trailers-only answer
	} else {
		s.endUpSpan(0)
	}
	s.mu.Lock()
	s.upDone = true
	opened := s.up != nil
	quiet := s.answered || s.gone || s.closing
	s.mu.Unlock()
	switch {
	case g.stopped.Err() != nil:
		s.answer(shutdownTrailers(g))
	case st != nil && apiAnswered(*st):
		s.answer(relayedTrailers(st.Trailer))
	case quiet:
	default:
		if err == nil {
			err = fmt.Errorf("grpc-status %d: %s", st.Code, st.Message)
		}
		g.relayError(s.u)
		if !opened {
			g.markDown(s.u, err)
		}
		s.answer(s.failure(err))
	}
	s.release()
}

// apiAnswered reports whether st is the API's own status (its trailers
// carry it), not one h2upstream made up for a broken stream.
func apiAnswered(st h2upstream.Status) bool {
	v := st.Trailer.Get("Grpc-Status")
	return v != "" && v == strconv.Itoa(st.Code)
}

// relayedTrailers are the API's status, message and details, never its
// other trailers (upstreamError's rule).
func relayedTrailers(t http.Header) http.Header {
	out := make(http.Header, 3)
	for _, k := range []string{"Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin"} {
		if v := t.Get(k); v != "" {
			out.Set(k, v)
		}
	}
	return out
}

// shutdown ends the session: the gateway is stopping. It runs on
// context.AfterFunc's goroutine, which the session's task covers: the
// session is not released before it is done.
func (s *callbackSession) shutdown() {
	s.mu.Lock()
	s.stopping = true
	s.mu.Unlock()
	s.answer(shutdownTrailers(s.g))
	s.mu.Lock()
	s.stopping = false
	s.mu.Unlock()
	s.release()
}

func shutdownTrailers(g *Gateway) http.Header {
	return wire.GRPCTrailers(wire.ToWire(g.log, agentv1connect.SessionServiceConnectProcedure, errs.New(errs.Unavailable, "the gateway is shutting down; reconnect")))
}

// failure logs an upstream failure (rate-limited, as upstreamError does)
// and returns the daemon's UNAVAILABLE.
func (s *callbackSession) failure(err error) http.Header {
	proc := agentv1connect.SessionServiceConnectProcedure
	s.g.lines.LogContext(s.spanContext(), slog.LevelWarn, "failed\x1f"+proc, "relay to the API failed", "procedure", proc, telemetry.LogPeer, s.addr,
		"elapsed", s.g.clock.Now().Sub(s.start).String(), "err", err)
	return wire.GRPCTrailers(wire.ToWireContext(s.spanContext(), s.g.log, proc, errs.New(errs.Unavailable, "the control plane is unavailable; retry later")))
}

// answer ends the daemon's stream with tr (once) and the upstream stream.
func (s *callbackSession) answer(tr http.Header) {
	s.mu.Lock()
	if s.answered {
		s.mu.Unlock()
		return
	}
	s.answered = true
	s.mu.Unlock()
	_ = s.d.WriteTrailers(tr)
	s.mu.Lock()
	s.trailed = true
	s.mu.Unlock()
	s.resetRequest()
	s.endUp()
}

// resetRequest resets the daemon's stream once its answer is written if
// its request is still open, as net/http does after a handler's answer.
func (s *callbackSession) resetRequest() {
	if s.d.Queued() == 0 && !s.d.RequestEnded() {
		s.d.Reset(http2.ErrCodeNo)
	}
}

// endUp ends the upstream stream, or its opening, unless it ended.
func (s *callbackSession) endUp() {
	s.mu.Lock()
	s.closing = true
	up, done, cancel := s.up, s.upDone, s.openCancel
	s.mu.Unlock()
	if cancel != nil {
		cancel()
	}
	if up != nil && !done {
		up.Reset()
	}
}

// release gives back the session's slot and task once both streams
// ended.
func (s *callbackSession) release() {
	s.mu.Lock()
	if !s.dDone || !s.upDone || s.stopping || s.released {
		s.mu.Unlock()
		return
	}
	s.released = true
	stop := s.stopWatch
	s.early = nil
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
	s.endUpSpan(0) // the session ended before the API's headers
	s.span.End()
	<-s.g.held
	s.g.tasks.Leave()
}
