// Package gateway is the regional gateway (`better-compute gateway`).
//
// The gateway is stateless. It terminates the daemons' TLS (its serving
// certificate chains to the serving CA that bcd pins) and relays
// JoinService.Join and Renew to the API's agent listener over mTLS with its
// own identity. It never opens the seal (the join token is sealed to the
// JoinService key and bound to the CSR) and cannot mint certificates (join
// answers are signed with the join-signing key that bcd pins); a
// compromised gateway can drop or delay calls, not forge them. It also
// relays node sessions (SessionService.Connect, session.go): a bidi stream
// per node, forwarded to the API with the node's certificate; commands are
// signed by the control plane and verified by bcd, so the gateway cannot
// forge them either.
//
// Errors from the API are passed to the daemon unchanged (the API already
// answers with product codes); a failure to reach the API is UNAVAILABLE
// with a short message and the detail goes to the log only.
package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/certfile"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
	"github.com/better-compute/better-compute/internal/shared/tasks"
)

const (
	// shutdownGrace bounds a graceful shutdown in Run.
	shutdownGrace = 15 * time.Second
	// LinesPerMinute is how many lines of each kind a caller can make the
	// gateway write per minute (R15.4); each says how many of its kind were
	// suppressed since the last.
	LinesPerMinute = 10
)

// noCompression unregisters gzip from a handler, both ways. SECURITY:
// connect-go inflates a compressed message to its end before it refuses it
// as larger than ReadMaxBytes, so a 64 KiB gzip body from anyone who can
// reach the gateway would cost inflating ~64 MiB; bcd never compresses
// (and answers, a few KiB, gained nothing from gzip).
var noCompression = connect.WithCompression("gzip", nil, nil)

// Options are the process-level inputs that do not belong in the file.
type Options struct {
	Log   *slog.Logger
	Clock clock.Clock
	// Ready, when set, receives the address Run listens on (listen on port
	// 0 and learn the port here).
	Ready func(addr string)
	// MetricsReady, when set, receives the address of the [metrics]
	// listener.
	MetricsReady func(addr string)
	// Tracer records a server span per call and a client span per relayed
	// attempt, whose context goes upstream (nil: the global provider, a
	// no-op unless tracing.Setup ran).
	Tracer trace.TracerProvider
	// LocalAPI, when set, is the API's agent handler in this process: the
	// gateway relays to it in memory instead of api_url (inprocess.go).
	LocalAPI http.Handler
}

// Gateway relays agent calls to the API. Build it with New.
type Gateway struct {
	cfg   Config
	ready func(addr string)
	log   *slog.Logger
	clock clock.Clock
	// ups are the API replicas (api_urls), each with its own connections
	// (upstreams.go); nextUp turns over them.
	ups    []*upstream
	nextUp atomic.Uint64
	held   chan struct{} // one slot per held session (MaxSessions)
	// stop ends every relayed session (Shutdown): a session outlives any
	// graceful wait, so the daemons are told to reconnect elsewhere.
	stopped context.Context
	stop    context.CancelFunc
	sem     chan struct{}
	// lines writes the lines a caller can cause (net/http's handshake
	// failures, busy and relay warnings) rate-limited (LinesPerMinute).
	lines   *ratelimit.Logger
	handler http.Handler
	// hs serves the daemons (daemon_http2 = "net/http"), or only the
	// HTTP/1.1 connections h2 hands over through h1 ("framer").
	hs *http.Server
	h2 *h2server.Server
	h1 *h2server.HandOver
	// pair is the serving certificate in force (readiness, expiry).
	pair         *certfile.Pair
	metrics      *metrics
	metricsReady func(addr string)
	tracer       trace.TracerProvider
	ds           atomic.Pointer[http.Server] // the [metrics] listener's, once serving
	// tasks are the goroutines the gateway starts beside net/http's: the
	// health checker and its checks, the relayed attempts of a join or
	// renewal, the daemon -> API half of each session, the in-process
	// API's handlers, the [metrics] listener's serve loop, and the
	// handlers themselves. Shutdown waits for them all, so nothing the
	// gateway started outlives it (in serve's process, the API's store
	// closes right after).
	tasks tasks.Tracker
}

// New loads the gateway's certificate and the API's CA and builds the
// upstream client. Errors are INVALID_CONFIG naming the key.
func New(cfg Config, o Options) (*Gateway, error) {
	cfg.local = o.LocalAPI != nil
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	g := &Gateway{cfg: cfg, log: o.Log, tracer: o.Tracer, clock: o.Clock, ready: o.Ready, metricsReady: o.MetricsReady, sem: make(chan struct{}, cfg.MaxConcurrent)}
	if g.log == nil {
		g.log = slog.Default()
	}
	if g.clock == nil {
		g.clock = clock.Real{}
	}
	g.lines = ratelimit.NewLogger(g.log, ratelimit.New(g.clock, LinesPerMinute, time.Minute))
	// R16.1: a certificate or CA file written over while the gateway runs
	// is used from the next handshake on, once it passes the same checks.
	pair, err := certfile.LoadPair(cfg.CertFile, cfg.KeyFile, g.checkCert, g.log)
	if err != nil {
		var ke *errs.E
		if errors.As(err, &ke) {
			return nil, err
		}
		return nil, badKey("cert_file", "load the gateway certificate and key: %v", err)
	}
	leaf := pair.Get().Leaf
	g.pair = pair
	if o.LocalAPI != nil {
		g.ups = []*upstream{g.newLocalUpstream(o.LocalAPI)}
	} else if err := g.remoteUpstreams(pair); err != nil {
		return nil, err
	}

	g.newMetrics()
	g.held = make(chan struct{}, cfg.MaxSessions)
	g.stopped, g.stop = context.WithCancel(context.Background())

	mux := http.NewServeMux()
	mux.Handle(g.joinHandler())
	mux.Handle(g.sessionHandler())
	// Counted: Shutdown waits for the calls still running after a grace
	// that ran out.
	g.handler = g.tasks.Handler(tracing.Handler(g.tracer, peerContext(mux)), errStopped.Error())

	g.hs = &http.Server{
		Handler:           g.handler,
		ReadHeaderTimeout: handshakeTimeout,
		// Per request (per stream on HTTP/2). Session streams lift both
		// (session.go); their liveness is the heartbeat and HTTP/2 pings.
		ReadTimeout:    cfg.RequestTimeout + 10*time.Second,
		WriteTimeout:   cfg.RequestTimeout + 10*time.Second,
		IdleTimeout:    idleTimeout,
		MaxHeaderBytes: maxHeaderBytes,
		ErrorLog:       g.lines.ErrorLog(slog.LevelWarn, "gateway"),
		// Pings find daemons that vanished without closing their connection.
		// 16 KiB frames (the HTTP/2 minimum): a daemon's client holds a
		// scratch buffer of this size while its session's body is open.
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:      maxStreamsPerConn,
			SendPingTimeout:           pingInterval,
			PingTimeout:               pingTimeout,
			MaxReadFrameSize:          16 << 10,
			MaxReceiveBufferPerStream: maxQueuedPerStream,
		},
		TLSConfig: &tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return pair.Get(), nil },
			NextProtos:     []string{"h2", "http/1.1"},
			// A daemon presents its node certificate on Renew and on
			// sessions; the API verifies it (byte for byte against
			// node_certs), so the gateway only requests it here, and
			// refuses a session without one (session.go).
			ClientAuth: tls.RequestClientCert,
			// TLS 1.3 session tickets (crypto/tls's own: on by default,
			// keys made in memory, a new one every 24 h, each accepted
			// for 7 days, all by this clock), so a daemon that reconnects
			// resumes instead of a full handshake. SECURITY: a resumed
			// connection carries the client certificate of the
			// handshake that issued its ticket; crypto/tls does not
			// resume one whose certificate has expired by now (it falls
			// back to a full handshake), and the gateway forwards it to
			// the API exactly as a presented one, which checks it on
			// every call (revoked, superseded, retired, expired).
			// Tickets are sealed with keys that never leave this
			// process: another gateway cannot resume them.
			Time: g.clock.Now,
		},
	}
	if cfg.TLSKeyExchange == KeyExchangeX25519 {
		// SECURITY: classical only, by the operator's choice (config.go).
		g.hs.TLSConfig.CurvePreferences = []tls.CurveID{tls.X25519}
	}
	if cfg.DaemonHTTP2 == DaemonHTTP2Framer {
		if err := g.newFramer(g.hs.TLSConfig.Clone()); err != nil {
			return nil, err
		}
	}
	g.log.Info("gateway configured", "api_urls", strings.Join(cfg.apiURLs(), ","), "cert_not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
	return g, nil
}

// upstreamOptions are the options of every client toward the API, then
// extra.
func (g *Gateway) upstreamOptions(extra ...connect.ClientOption) []connect.ClientOption {
	return append([]connect.ClientOption{
		connect.WithGRPC(),
		connect.WithReadMaxBytes(g.cfg.MaxBodyBytes),
		connect.WithSendMaxBytes(g.cfg.MaxBodyBytes),
		// Agent messages are small and the API is near: gzip on this hop
		// costs more CPU than it saves.
		connect.WithAcceptCompression("gzip", nil, nil),
	}, extra...)
}

// checkCert vets the gateway's certificate, at start and at every reload.
func (g *Gateway) checkCert(c *tls.Certificate) error {
	leaf := c.Leaf
	if now := g.clock.Now(); now.After(leaf.NotAfter) || now.Before(leaf.NotBefore) {
		return badKey("cert_file", "the gateway certificate is valid from %s to %s; issue a new one with better-compute pki issue-gateway",
			leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	// The one certificate is both the serving certificate and the client
	// identity toward the API, so it needs both usages.
	if !hasEKU(leaf, x509.ExtKeyUsageServerAuth) || !hasEKU(leaf, x509.ExtKeyUsageClientAuth) {
		return badKey("cert_file", "the certificate needs extended key usages serverAuth and clientAuth; issue it with better-compute pki issue-gateway")
	}
	return nil
}

func hasEKU(c *x509.Certificate, u x509.ExtKeyUsage) bool {
	return slices.Contains(c.ExtKeyUsage, u) || slices.Contains(c.ExtKeyUsage, x509.ExtKeyUsageAny)
}

// Handler returns the agent handler (JoinService). It reads the daemon's
// address and client certificate from the request's TLS state.
func (g *Gateway) Handler() http.Handler { return g.handler }

// Run listens on cfg.Listen with TLS and serves until ctx ends, then shuts
// down gracefully. It returns once every goroutine the gateway started has
// ended.
func (g *Gateway) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", g.cfg.Listen)
	if err != nil {
		return badKey("listen", "listen %s: %v", g.cfg.Listen, err)
	}
	eg, gctx := errgroup.WithContext(ctx)
	eg.Go(func() error {
		if err := g.Serve(ln); err != nil {
			return fmt.Errorf("serve: %w", err)
		}
		return nil
	})
	g.log.Info("gateway listening", "addr", ln.Addr().String())
	if g.ready != nil {
		g.ready(ln.Addr().String())
	}
	eg.Go(func() error {
		// ctx ended, or serving failed: either way the gateway stops.
		<-gctx.Done()
		g.log.Info("gateway shutting down")
		sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		return g.Shutdown(sctx)
	})
	return eg.Wait()
}

// Serve serves TLS (HTTP/2 and HTTP/1.1) on ln until Shutdown; it returns nil
// after a shutdown. It starts the health checks of several API replicas
// and the [metrics] listener, which Shutdown stops and waits for. A Gateway
// serves once.
func (g *Gateway) Serve(ln net.Listener) error {
	if len(g.ups) > 1 {
		// Refused only after Shutdown, which ServeTLS reports below.
		g.tasks.Go(g.checkHealth)
	}
	if err := g.serveDiagnostics(); err != nil {
		ln.Close()
		return err
	}
	if g.h2 != nil {
		return g.serveFramer(ln)
	}
	// ServeTLS configures HTTP/2 on the server; the certificate comes from
	// TLSConfig.
	if err := g.hs.ServeTLS(ln, "", ""); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// serveFramer serves ln with h2server, and the HTTP/1.1 connections it
// hands over with net/http, one of the gateway's tasks.
func (g *Gateway) serveFramer(ln net.Listener) error {
	g.tasks.Go(func() {
		// h1 closed (Shutdown) ends it too.
		if err := g.hs.Serve(g.h1); !errors.Is(err, http.ErrServerClosed) && !errors.Is(err, net.ErrClosed) {
			g.log.Error("gateway: serving HTTP/1.1 failed", "err", err)
		}
	})
	if err := g.h2.Serve(ln); !errors.Is(err, h2server.ErrServerClosed) {
		return err
	}
	return nil
}

// Shutdown stops accepting, ends the relayed sessions, waits for calls in
// flight until ctx ends (then closes their connections), and returns once
// every goroutine the gateway started has ended; it then closes the idle
// connections to the API. Calling it again is harmless.
func (g *Gateway) Shutdown(ctx context.Context) error {
	// Sessions never finish on their own: end them (the daemons reconnect,
	// to another gateway if this one is going away) so the graceful wait
	// covers only joins and renewals.
	g.stop()
	if ds := g.ds.Load(); ds != nil {
		_ = ds.Close()
	}
	var err error
	if g.h2 != nil {
		// h1 first: h2 waits for a connection it is handing over.
		_ = g.h1.Close()
		// Closes the connections still open when the grace runs out, and
		// waits for every goroutine of h2's.
		err = g.h2.Shutdown(ctx)
	}
	if herr := g.hs.Shutdown(ctx); herr != nil {
		// The grace is over: the calls still in flight end now (their
		// contexts end with their connections).
		_ = g.hs.Close()
		err = herr
	}
	g.tasks.Close()
	for _, u := range g.ups {
		u.closeIdle()
		if u.h2 != nil {
			// Its sessions ended with the tasks: this closes the
			// connections and waits for their goroutines.
			_ = u.h2.Close()
		}
	}
	return err
}

// errStopped is the outcome of work the gateway refused to start because
// it is shutting down.
var errStopped = errors.New("the gateway is shutting down")

// peer is what the gateway learned about the daemon's connection.
type peer struct {
	addr    string
	certDER []byte // the presented leaf, if any; unverified
}

type peerKey struct{}

// peerContext records the daemon's connection in the context and drops any
// Bc-Peer-* header the daemon sent.
func peerContext(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// SECURITY: Bc-Peer-* headers are the gateway's to set; a daemon's
		// own are never trusted. Upstream calls are built fresh, so these
		// would not be forwarded anyway; dropping them here keeps every
		// later reader honest too.
		for k := range r.Header {
			if strings.HasPrefix(http.CanonicalHeaderKey(k), wire.PeerHeaderPrefix) {
				delete(r.Header, k)
			}
		}
		p := peer{addr: r.RemoteAddr}
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			p.certDER = r.TLS.PeerCertificates[0].Raw
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), peerKey{}, p)))
	})
}

func peerOf(ctx context.Context) peer {
	p, _ := ctx.Value(peerKey{}).(peer)
	return p
}

// limit refuses a call at once when MaxConcurrent calls are in flight:
// queueing would only hold daemons' connections while the API is slow.
func (g *Gateway) limit() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			select {
			case g.sem <- struct{}{}:
			default:
				g.lines.LogContext(ctx, slog.LevelWarn, "busy", "gateway busy: call refused", "procedure", req.Spec().Procedure, telemetry.LogPeer, peerOf(ctx).addr, "max_concurrent", g.cfg.MaxConcurrent)
				return nil, wire.ToWireContext(ctx, g.log, req.Spec().Procedure, errs.New(errs.ResourcesLimited, "the gateway is busy; retry later"))
			}
			defer func() { <-g.sem }()
			return next(ctx, req)
		}
	}
}

// relay implements JoinService by forwarding to the API. It serves the JSON
// codecs; binary calls (what bcd sends) take rawJoinHandler.
type relay struct {
	agentv1connect.UnimplementedJoinServiceHandler
	g *Gateway
}

func (r *relay) Join(ctx context.Context, req *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
	return relayUnary(r.g, ctx, agentv1connect.JoinServiceJoinProcedure, req, func(u *upstream) func(context.Context, *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
		return u.join.Join
	})
}

func (r *relay) Renew(ctx context.Context, req *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
	return relayUnary(r.g, ctx, agentv1connect.JoinServiceRenewProcedure, req, func(u *upstream) func(context.Context, *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
		return u.join.Renew
	})
}

// Keys relays the rotation statements (R16.2): a daemon whose pins no
// longer match this gateway asks for them before it trusts it, and
// verifies each one itself, so the gateway has nothing to check.
func (r *relay) Keys(ctx context.Context, req *connect.Request[agentv1.KeysRequest]) (*connect.Response[agentv1.KeysResponse], error) {
	return relayUnary(r.g, ctx, agentv1connect.JoinServiceKeysProcedure, req, func(u *upstream) func(context.Context, *connect.Request[agentv1.KeysRequest]) (*connect.Response[agentv1.KeysResponse], error) {
		return u.join.Keys
	})
}

// relayUnary forwards one call to an API replica with the daemon's address
// and, on Renew, its client certificate (unverified: the API checks it),
// and passes the answer back. It resends the call to another replica where
// that is safe (hedge.go).
func relayUnary[Req, Res any](g *Gateway, ctx context.Context, procedure string, req *connect.Request[Req],
	call func(*upstream) func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) (*connect.Response[Res], error) {
	p := peerOf(ctx)
	ctx, cancel := context.WithTimeout(ctx, g.cfg.RequestTimeout)
	// Ends the attempts still running once one settled the call: their
	// late answers are dropped.
	defer cancel()
	start := g.clock.Now()
	h := newHedge[Res](g, procedure)
	h.send = func(u *upstream) {
		up := connect.NewRequest(req.Msg)
		up.Header().Set(wire.PeerAddrHeader, p.addr)
		if procedure == agentv1connect.JoinServiceRenewProcedure && len(p.certDER) > 0 {
			wire.SetPeerCertificate(up.Header(), p.certDER)
		}
		// results holds an attempt per replica: the send never blocks.
		if !g.tasks.Go(func() {
			res, err := call(u)(ctx, up)
			h.results <- attempt[Res]{u: u, res: res, err: err}
		}) {
			h.results <- attempt[Res]{u: u, err: errStopped}
		}
	}
	res, err := h.run(ctx)
	if err != nil {
		return nil, g.upstreamError(ctx, procedure, p, start, err)
	}
	return connect.NewResponse(res.Msg), nil
}

// rawMsg is a message relayed as the bytes received: the gateway never
// decodes a join or renewal (it has no use for the sealed token, the CSR or
// the signed answer), so it spends nothing on protobuf and forwards exactly
// what the daemon and the API sent. The API decodes and checks them.
type rawMsg struct{ b []byte }

// rawCodec is the binary codec ("proto") over rawMsg. connect also uses
// the "proto" codec for its own messages (a gRPC error's status and
// details), which it encodes as protobuf.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }

func (c rawCodec) Marshal(m any) ([]byte, error) { return c.MarshalAppend(nil, m) }

// MarshalAppend lets connect write into its pooled buffer.
func (rawCodec) MarshalAppend(dst []byte, m any) ([]byte, error) {
	switch m := m.(type) {
	case *rawMsg:
		return append(dst, m.b...), nil
	case proto.Message:
		return proto.MarshalOptions{}.MarshalAppend(dst, m)
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", m)
}

// Unmarshal copies: connect reuses its buffer.
func (rawCodec) Unmarshal(b []byte, m any) error {
	switch m := m.(type) {
	case *rawMsg:
		m.b = append([]byte(nil), b...)
		return nil
	case proto.Message:
		return proto.Unmarshal(b, m)
	}
	return fmt.Errorf("rawCodec: cannot unmarshal into %T", m)
}

// joinHandler serves JoinService: calls with the binary codec (gRPC,
// gRPC-Web, Connect) are relayed as bytes; the JSON codecs go through the
// typed relay.
func (g *Gateway) joinHandler() (string, http.Handler) {
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(g.cfg.MaxBodyBytes),
		connect.WithSendMaxBytes(g.cfg.MaxBodyBytes),
		noCompression,
		connect.WithInterceptors(g.limit()),
	}
	path, typed := agentv1connect.NewJoinServiceHandler(&relay{g: g}, opts...)
	raw := make(map[string]http.Handler, 2)
	for _, proc := range []string{agentv1connect.JoinServiceJoinProcedure, agentv1connect.JoinServiceRenewProcedure} {
		raw[proc] = connect.NewUnaryHandler(proc, func(ctx context.Context, req *connect.Request[rawMsg]) (*connect.Response[rawMsg], error) {
			return relayUnary(g, ctx, proc, req, func(u *upstream) func(context.Context, *connect.Request[rawMsg]) (*connect.Response[rawMsg], error) {
				return u.raw[proc].CallUnary
			})
		}, append(opts, connect.WithCodec(rawCodec{}))...)
	}
	return path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h, ok := raw[r.URL.Path]; ok && binaryCodec(r.Header.Get("Content-Type")) {
			h.ServeHTTP(w, r)
			return
		}
		typed.ServeHTTP(w, r)
	})
}

// binaryCodec reports whether a request's content type names the binary
// protobuf codec in any of connect's protocols.
func binaryCodec(contentType string) bool {
	ct, _, _ := strings.Cut(contentType, ";")
	switch strings.ToLower(strings.TrimSpace(ct)) {
	case "application/grpc", "application/grpc+proto", "application/grpc-web", "application/grpc-web+proto", "application/proto":
		return true
	}
	return false
}

// upstreamError passes the API's own answer through (code, message and
// details; never its headers or trailers) and turns anything else (no
// connection, a timeout, a malformed answer) into UNAVAILABLE with the
// detail in the log only.
func (g *Gateway) upstreamError(ctx context.Context, procedure string, p peer, start time.Time, err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) && connect.IsWireError(ce) {
		out := connect.NewError(ce.Code(), errors.New(ce.Message()))
		for _, d := range ce.Details() {
			out.AddDetail(d)
		}
		return out
	}
	g.lines.LogContext(ctx, slog.LevelWarn, "failed\x1f"+procedure, "relay to the API failed", "procedure", procedure, telemetry.LogPeer, p.addr,
		"elapsed", g.clock.Now().Sub(start).String(), "err", err)
	return wire.ToWireContext(ctx, g.log, procedure, errs.New(errs.Unavailable, "the control plane is unavailable; retry later"))
}
