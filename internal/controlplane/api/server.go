// Package api is the control plane's HTTP surface: the operator API (Connect:
// JSON over HTTP or gRPC, authenticated by API keys), the well-known
// document, health and readiness. Handlers translate between the wire and the
// domain packages; their errors are mapped to the wire by wire.Interceptor
// (authentication, which refuses a call before its handler runs, calls
// wire.ToWireContext itself).
package api

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/gen/bettercompute/v1/bcv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/commands"
	"github.com/better-compute/better-compute/internal/controlplane/console"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/joinreq"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/nodes"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/version"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// DefaultBasePath is where the API is served.
const DefaultBasePath = wire.DefaultBasePath

// DefaultMaxBodyBytes bounds request bodies.
const DefaultMaxBodyBytes = 1 << 20

// LinesPerMinute is how many lines of each kind an unauthenticated request
// can make the API write per minute (R15.4).
const LinesPerMinute = 10

// GatewayInfo is what the well-known document says about the gateway.
type GatewayInfo struct {
	URL        string
	ServerName string
}

// Config lists the API server's dependencies.
type Config struct {
	DB    *store.DB
	Clock clock.Clock
	Log   *slog.Logger
	// BasePath prefixes every route (default /api/compute).
	BasePath string
	// Bundle is the machine PKI; nil means joining is not configured and
	// join calls answer INVALID_CONFIG.
	Bundle *ca.Bundle
	// Gateway, when set, is published in the well-known document.
	Gateway *GatewayInfo
	// MaxBodyBytes bounds request bodies (default 1 MiB).
	MaxBodyBytes int
	// CertTTL is JoinService's certTtlSeconds (default and maximum 24 h).
	CertTTL time.Duration
	// SVIDForm is the form of issued node certificates
	// (nodeident.Config.SVIDForm; default pki.SVIDFormPage).
	SVIDForm string
	// Attestors names JoinService's attestors (KnownAttestors; default
	// DefaultAttestors, join-token only).
	Attestors []string
	// TPMPools is the tpm attestor's EK trust per pool (R9.2).
	TPMPools []tpm.Pool
	// JoinRequestLimits bound the join requests unauthenticated callers
	// can make (R15.4); zero fields take JoinService's defaults.
	JoinRequestLimits join.RequestLimits
	// JoinVouchWait is how long a discovery join waits for its vouch
	// (join.Config.VouchWait); zero means join.DefaultVouchWait.
	JoinVouchWait time.Duration
	// DownloadsDir, when set, serves the bcd builds under
	// {basePath}/downloads/ (R11.5; see downloads.go).
	DownloadsDir string
	// SessionPoll is how often the session service looks for queued
	// commands nobody notified it of (session.Config.Poll; 0: the
	// default).
	SessionPoll time.Duration
	// HeartbeatMAC agrees a heartbeat key with each daemon that offers
	// one, whose heartbeats are then checked by MAC instead of signature
	// (session.Config.HeartbeatMAC; [session] heartbeat_mac).
	HeartbeatMAC bool
	// Metrics, when set, counts joins, renewals, token spends, decisions,
	// issuance, commands and sessions (apimetrics.NewAPI).
	Metrics *apimetrics.API
	// Tracer, when set, records a server span per call (tracing.Handler);
	// nil: the global provider, a no-op unless tracing.Setup ran.
	Tracer trace.TracerProvider
}

// Server is the API.
type Server struct {
	cfg Config
	db  *store.DB
	log *slog.Logger
	// lines writes what an unauthenticated request can cause (a failed key
	// lookup, readiness, downloads) rate-limited: LinesPerMinute per kind.
	lines   *ratelimit.Logger
	console *console.Console
	hub     *events.Hub
	tenancy *tenancy.Service
	authz   *authz.Service
	tokens  *tokens.Service
	// joinReqs lists and decides join requests (R10).
	joinReqs *joinreq.Service
	nodes    *nodes.Service
	// commands is the operator's command queue (commands.go).
	commands *commands.Service
	join     *join.Service
	// sessions is SessionService (R12.1), served on the agent listener.
	sessions *session.Service
	mux      *http.ServeMux
	handler  http.Handler
	// procedures is the bounded set of operator procedures (RouteLabel).
	procedures map[string]bool
	// cursors seals the ids and cursors of events and audit rows (R14.3).
	cursors *events.Codec
}

// New builds the API server.
func New(cfg Config) (*Server, error) {
	if cfg.DB == nil {
		return nil, errs.New(errs.InvalidConfig, "api: a store is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.BasePath == "" {
		cfg.BasePath = DefaultBasePath
	}
	cfg.BasePath = "/" + strings.Trim(cfg.BasePath, "/")
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	hub := events.NewHub()
	cursors, err := events.NewCodec(cfg.DB.StreamKey())
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg: cfg, db: cfg.DB, log: cfg.Log, hub: hub, cursors: cursors,
		lines:    ratelimit.NewLogger(cfg.Log, ratelimit.New(cfg.Clock, LinesPerMinute, time.Minute)),
		tenancy:  tenancy.New(tenancy.Config{DB: cfg.DB, Hub: hub}),
		authz:    authz.New(authz.Config{DB: cfg.DB, Hub: hub}),
		tokens:   tokens.New(tokens.Config{DB: cfg.DB, Hub: hub}),
		joinReqs: joinreq.New(joinreq.Config{DB: cfg.DB, Hub: hub, Clock: cfg.Clock, Metrics: cfg.Metrics}),
		mux:      http.NewServeMux(),
		// Read once: RouteLabel runs on every request.
		procedures: operatorProcedures(),
	}
	// One identity core checks, issues and records refusals for joins,
	// renewals and sessions, with one refusal limiter.
	core, err := nodeident.New(nodeident.Config{DB: cfg.DB, Bundle: cfg.Bundle, Clock: cfg.Clock, Log: cfg.Log, Hub: hub, CertTTL: cfg.CertTTL,
		SVIDForm: cfg.SVIDForm, Metrics: cfg.Metrics})
	if err != nil {
		return nil, err
	}
	reg, err := attestors(cfg.Attestors, core, cfg.TPMPools)
	if err != nil {
		return nil, err
	}
	s.sessions = session.New(session.Config{DB: cfg.DB, Core: core, Clock: cfg.Clock, Log: cfg.Log, Hub: hub, Bundle: cfg.Bundle, Poll: cfg.SessionPoll, Metrics: cfg.Metrics,
		HeartbeatMAC: cfg.HeartbeatMAC})
	if s.join, err = join.New(join.Config{DB: cfg.DB, Core: core, Attestors: reg, Clock: cfg.Clock, Log: cfg.Log, Hub: hub, Limits: cfg.JoinRequestLimits, Metrics: cfg.Metrics, VouchWait: cfg.JoinVouchWait,
		OnIdentityChanged: func(nodeID string) { s.sessions.EndNode(nodeID, session.EndReclaimed) }}); err != nil {
		return nil, err
	}
	// A retired node's session on this replica ends at once (R12.1); other
	// replicas' end at their next check of held sessions.
	s.nodes = nodes.New(nodes.Config{DB: cfg.DB, Hub: hub, EndSession: func(id string) { s.sessions.EndNode(id, session.EndRetired) }})
	s.commands = commands.New(commands.Config{DB: cfg.DB, Hub: hub, Log: cfg.Log, Clock: cfg.Clock, Notify: s.sessions.Notify, Metrics: cfg.Metrics})
	op := &operator{s: s}
	opts := []connect.HandlerOption{
		connect.WithCodec(jsonCodec{}),
		connect.WithReadMaxBytes(cfg.MaxBodyBytes),
		// SECURITY: no request decompression. connect-go inflates a
		// compressed message to its end to report its size, past
		// ReadMaxBytes (a 1 MB gzip body inflating to 1 GiB cost a second
		// of CPU); no client of ours compresses requests. Answers are not
		// compressed either (connect registers both directions together).
		connect.WithCompression("gzip", nil, nil),
		connect.WithInterceptors(wire.Interceptor(cfg.Log), s.authInterceptor()),
	}
	errw := connect.NewErrorWriter(opts...)
	for _, mount := range []func() (string, http.Handler){
		func() (string, http.Handler) { return bcv1connect.NewTenantServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewSiteServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewPoolServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewApiKeyServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewJoinTokenServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewJoinRequestServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewEventServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewNodeServiceHandler(op, opts...) },
		func() (string, http.Handler) { return bcv1connect.NewCommandServiceHandler(op, opts...) },
	} {
		path, h := mount()
		s.mux.Handle(cfg.BasePath+path, http.StripPrefix(cfg.BasePath, s.authenticateFirst(h, errw)))
		// R20.4: standard gRPC clients (grpcurl) cannot add a path prefix,
		// so the same services, authenticated the same way, answer at the
		// root path too.
		if cfg.BasePath != "/" {
			s.mux.Handle(path, s.authenticateFirst(h, errw))
		}
	}
	s.mountReflection(errw)
	s.mux.HandleFunc("GET "+cfg.BasePath+"/.well-known/better-compute", s.wellKnown)
	s.mux.HandleFunc("GET "+cfg.BasePath+SPIFFEBundlePath, s.spiffeBundleHandler)
	s.mountDownloads()
	// The web console calls this server's own handler with the signed-in
	// key (console package doc).
	con, err := console.New(console.Config{API: s, BasePath: cfg.BasePath, Clock: cfg.Clock, Log: cfg.Log})
	if err != nil {
		return nil, err
	}
	s.console = con
	s.mux.Handle(con.Prefix()+"/", con)
	// A browser asks for /favicon.ico before it reads the console's icon
	// link: no content, rather than a 404 for every page it opens.
	s.mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	s.mux.HandleFunc("GET /readyz", s.ready)
	s.handler = tracing.Handler(cfg.Tracer, http.MaxBytesHandler(s.mux, int64(cfg.MaxBodyBytes)+4096))
	return s, nil
}

// ServeHTTP serves the API.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.handler.ServeHTTP(w, r) }

// Console exposes the web console, whose Run the process starts with its
// other background loops (it drops expired sessions).
func (s *Server) Console() *console.Console { return s.console }

// Mux exposes the route table so other parts of the control plane (the
// agent service, downloads) mount beside the operator API.
func (s *Server) Mux() *http.ServeMux { return s.mux }

// Tenancy exposes the tenancy service (bootstrap in `dev`).
func (s *Server) Tenancy() *tenancy.Service { return s.tenancy }

// Sessions exposes SessionService: controllers notify it of new commands,
// and it wakes them on results.
func (s *Server) Sessions() *session.Service { return s.sessions }

// Hub exposes the event hub, so other services publishing events wake
// readers.
func (s *Server) Hub() *events.Hub { return s.hub }

// ReadyHandler is /readyz, for another listener (the metrics one).
func (s *Server) ReadyHandler() http.Handler { return http.HandlerFunc(s.ready) }

// ready is /readyz: 200 while the database answers reads and takes
// writes, else 503 with the reason (R19.1), so load balancers and gateways
// route away from a replica whose database is down, read-only or full.
// The write check costs at most one small write a second (CheckWrites).
func (s *Server) ready(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2e9)
	defer cancel()
	what, err := "reads", s.db.Ping(ctx)
	if err == nil {
		what, err = "writes", s.db.CheckWrites(ctx)
	}
	if err != nil {
		s.lines.Log(slog.LevelWarn, "not-ready", "not ready", "failing", what, "err", err)
		reason := store.UnavailableReason(err)
		if reason == "" {
			reason = "failing"
		}
		http.Error(w, "database unavailable: "+what+" fail ("+reason+")", http.StatusServiceUnavailable)
		return
	}
	w.Write([]byte("ok\n"))
}

// authenticateFirst authenticates an operator call by its bearer API key
// before h reads a byte of its body, and passes the principal on in the
// request's context. SECURITY: an unauthenticated caller costs one key
// lookup, never the parsing of its (up to MaxBodyBytes) message
// (R15.4); the refusal is written in the call's protocol by errw. A
// procedure the schema does not have goes to h unauthenticated: connect
// answers it 404 without reading the body.
func (s *Server) authenticateFirst(h http.Handler, errw *connect.ErrorWriter) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.procedures[r.URL.Path] {
			h.ServeHTTP(w, r)
			return
		}
		p, err := s.authenticate(r.Context(), r.Header.Get("Authorization"))
		if err != nil {
			log := s.log
			if e, ok := errs.As(err); !ok || e.Code == errs.Unavailable {
				// The store failed (UNAVAILABLE, or an error it did not
				// classify): no key vouches for the caller, so the line
				// is rate-limited and ToWire writes none.
				s.lines.LogContext(r.Context(), slog.LevelError, "authenticate", "authenticate an operator call", "procedure", r.URL.Path, telemetry.LogPeer, r.RemoteAddr, "err", err)
				log = discard
			}
			_ = errw.Write(w, r, wire.ToWireContext(r.Context(), log, r.URL.Path, err))
			return
		}
		h.ServeHTTP(w, r.WithContext(authz.WithPrincipal(r.Context(), p)))
	})
}

func (s *Server) authenticate(ctx context.Context, header string) (authz.Principal, error) {
	bearer, ok := strings.CutPrefix(header, "Bearer ")
	if !ok {
		return authz.Principal{}, errUnauthenticated
	}
	return authz.Authenticate(ctx, s.db, bearer)
}

var discard = slog.New(slog.DiscardHandler)

var errUnauthenticated = errs.New(errs.Unauthenticated, "a valid API key is required (Authorization: Bearer bck_…)")

// authInterceptor refuses an operator call that authenticateFirst did not
// authenticate (a handler mounted without it).
func (s *Server) authInterceptor() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			if _, ok := authz.From(ctx); !ok {
				return nil, errUnauthenticated
			}
			return next(ctx, req)
		}
	}
}

// BuildWellKnown assembles the well-known document.
func (s *Server) BuildWellKnown() (wire.WellKnown, error) {
	doc := wire.WellKnown{Name: "better-compute", Version: version.Version, BasePath: s.cfg.BasePath,
		Protocol: wire.WellKnownProtocol{Min: version.ProtocolMin, Max: version.ProtocolMax}}
	if b := s.cfg.Bundle.Now(); b != nil {
		j, err := b.WellKnownJoin()
		if err != nil {
			return doc, err
		}
		doc.Join = &j
		doc.SPIFFE = s.wellKnownSPIFFE(b)
		if g := s.cfg.Gateway; g != nil && g.URL != "" {
			pins, err := b.Pins()
			if err != nil {
				return doc, err
			}
			doc.Gateway = &wire.WellKnownGateway{URL: g.URL, ServerName: g.ServerName, ServingCAPin: pins.ServingCA}
		}
	}
	return doc, nil
}

func (s *Server) wellKnown(w http.ResponseWriter, r *http.Request) {
	doc, err := s.BuildWellKnown()
	if err != nil {
		s.log.Error("well-known document", "err", err)
		http.Error(w, "internal error\n", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "max-age=60")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(doc)
}

// jsonCodec is Connect's JSON codec with zero values written out, so that
// `usesLeft: 0` and `allowReclaim: false` appear in answers. Unknown fields
// in requests are refused.
type jsonCodec struct{}

func (jsonCodec) Name() string { return "json" }

func (jsonCodec) Marshal(v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, errs.New(errs.Internal, "not a protobuf message")
	}
	return protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(m)
}

func (jsonCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return errs.New(errs.Internal, "not a protobuf message")
	}
	if len(b) == 0 {
		return nil
	}
	return (protojson.UnmarshalOptions{}).Unmarshal(b, m)
}

// BasePath is where the API is mounted.
func (s *Server) BasePath() string { return s.cfg.BasePath }
