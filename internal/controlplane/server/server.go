package server

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/export"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/certfile"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// Options are the process-level inputs that do not belong in the file.
type Options struct {
	Log *slog.Logger
	// Secret decrypts the PKI bundle (BETTER_COMPUTE_SECRET).
	Secret []byte
	// Ready, when set, receives the API's listening address once it serves.
	Ready func(addr string)
	// Setup runs after the API is built and before it serves (dev uses it
	// to bootstrap).
	Setup func(ctx context.Context, s *api.Server, db *store.DB) error
	// AgentCert, when set, is the agent listener's certificate (dev makes
	// one in memory instead of files).
	AgentCert *tls.Certificate
	// AgentReady receives the agent listener's address.
	AgentReady func(addr string)
	// Bundle receives the loaded PKI (dev uses it to start the gateway).
	Bundle func(*ca.Bundle)
	// MetricsReady receives the metrics listener's address (listen on
	// port 0 and learn the port here).
	MetricsReady func(addr string)
	// Clock times the rate limit of the listeners' error lines (nil: the
	// wall clock).
	Clock clock.Clock
	// GatewayListener, when set, is where the in-process gateway ([gateway]
	// listen) serves instead of listening itself (dev opens it first: its
	// address goes into the well-known document).
	GatewayListener net.Listener
	// GatewayReady and GatewayMetricsReady receive the in-process
	// gateway's address and its [gateway.metrics] listener's.
	GatewayReady, GatewayMetricsReady func(addr string)
}

// Run serves the API until ctx ends, then shuts down gracefully. Every
// listener, the in-process gateway and the background work run as tasks of
// one group (serve); Run returns the first error once all of them ended,
// and only then closes the store.
func Run(ctx context.Context, cfg Config, o Options) error {
	log := o.Log
	if log == nil {
		log = slog.Default()
	}
	// With no [tracing] endpoint the global provider is a no-op.
	_, stopTracing, err := tracing.Setup(cfg.Tracing, tracing.ServiceAPI)
	if err != nil {
		return err
	}
	defer func() { _ = stopTracing(context.Background()) }()
	db, err := store.Open(ctx, cfg.Store, log)
	if err != nil {
		return err
	}
	defer db.Close()

	bundle, err := loadBundle(cfg, o, log)
	if err != nil {
		return err
	}
	ring, err := openRing(ctx, db, bundle, o.Secret, log)
	if err != nil {
		return err
	}
	reg, fleet, srv, handler, err := newMeteredAPI(ctx, cfg, o, db, bundle, log)
	if err != nil {
		return err
	}
	apiCert, err := loadAPICert(cfg, log)
	if err != nil {
		return err
	}
	l, err := listen(cfg, o, log, reg, srv, handler, apiCert, bundle)
	if err != nil {
		return err
	}
	exp := cfg.Export
	if fleet != nil {
		exp.Metrics = reg
	}
	return serve(ctx, cfg, o, log, l, srv, background(exp, db, srv, ring, log))
}

// serve runs every listener and the background work as tasks of one group
// until ctx ends or a listener fails, then shuts down in order: the
// servers and the in-process gateway (shutdown), then the background work.
// It returns the first error once every task and every request handler
// ended.
func serve(ctx context.Context, cfg Config, o Options, log *slog.Logger, l *listeners, srv *api.Server, bg []func(context.Context)) error {
	g, gctx := errgroup.WithContext(ctx)
	// The background work outlives the servers: a session ending writes
	// its disconnect, a join still finishing may queue work. The shutdown
	// task ends it once the servers stopped.
	bctx, stopBackground := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBackground()
	for _, run := range bg {
		g.Go(func() error { run(bctx); return nil })
	}
	l.serve(g)
	scheme := "http"
	if cfg.TLS.CertFile != "" {
		scheme = "https"
	}
	log.Info("API listening", "url", fmt.Sprintf("%s://%s%s", scheme, l.apiLn.Addr(), srv.BasePath()))
	if o.Ready != nil {
		o.Ready(l.apiLn.Addr().String())
	}
	g.Go(func() error {
		// ctx ended, or a listener failed: either way everything stops.
		<-gctx.Done()
		log.Info("shutting down")
		sctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		err := l.shutdown(sctx, srv)
		stopBackground()
		return err
	})
	return g.Wait()
}

// newMeteredAPI builds the API server and the handler that serves it.
// Without a metrics listener no one can read the metrics: the API counts
// nothing (a nil *apimetrics.API) and its handler is not instrumented.
func newMeteredAPI(ctx context.Context, cfg Config, o Options, db *store.DB, bundle *ca.Bundle, log *slog.Logger) (*prometheus.Registry, *apimetrics.API, *api.Server, http.Handler, error) {
	reg := prometheus.NewRegistry()
	var fleet *apimetrics.API
	if cfg.Metrics.Listen != "" {
		fleet = apimetrics.NewAPI(reg)
	}
	srv, err := newAPI(ctx, cfg, o, db, bundle, log, fleet)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	var handler http.Handler = srv
	if fleet != nil {
		handler = apiMetrics(reg, srv)
	}
	return reg, fleet, srv, handler, nil
}

// newAPIServer is the operator API's server (TLS with apiCert when set);
// its net/http error lines go through errLog.
func newAPIServer(cfg Config, handler http.Handler, apiCert *certfile.Pair, errLog *ratelimit.Logger) *http.Server {
	hs := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       cfg.Limits.read(),
		WriteTimeout:      cfg.Limits.write(),
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          errLog.ErrorLog(slog.LevelWarn, "api"),
		// R20.4: gRPC clients need HTTP/2; without tls.cert_file the
		// listener speaks it in cleartext with prior knowledge (grpcurl
		// -plaintext), beside HTTP/1.1.
		Protocols: apiProtocols(),
	}
	if apiCert != nil {
		hs.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return apiCert.Get(), nil }}
	}
	return hs
}

// apiProtocols are the operator listener's: HTTP/1.1, HTTP/2 over TLS, and
// HTTP/2 in cleartext.
func apiProtocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// instrument counts and times requests by route. The label comes from
// label (api.Server.RouteLabel): a bounded set decided by the route table,
// never the raw path, because it is taken before authentication. The code
// is the RPC's Connect/gRPC code for a procedure (codeLabel) and the HTTP
// status, bounded by http.Server to three digits, for the other routes.
func instrument(h http.Handler, label func(*http.Request) string, reqs *prometheus.CounterVec, dur *prometheus.HistogramVec) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		route := label(r) // before serving: handlers may rewrite r.URL
		sw := &statusWriter{ResponseWriter: w, code: 200}
		h.ServeHTTP(sw, r)
		reqs.WithLabelValues(route, codeLabel(r, sw, strings.HasPrefix(route, "/"))).Inc()
		dur.WithLabelValues(route).Observe(time.Since(start).Seconds())
	})
}

// newAPI builds the API server on db and bundle and makes sure the root
// tenant exists, then runs o.Setup.
func newAPI(ctx context.Context, cfg Config, o Options, db *store.DB, bundle *ca.Bundle, log *slog.Logger, m *apimetrics.API) (*api.Server, error) {
	var gw *api.GatewayInfo
	if cfg.Gateway.URL != "" {
		gw = &api.GatewayInfo{URL: cfg.Gateway.URL, ServerName: cfg.Gateway.ServerName}
	}
	if o.Bundle != nil {
		o.Bundle(bundle)
	}
	tpmPools, err := cfg.Join.TPM.AttestorPools()
	if err != nil {
		return nil, err
	}
	srv, err := api.New(api.Config{DB: db, Clock: clock.Real{}, Log: log, BasePath: cfg.BasePath, Bundle: bundle, Gateway: gw,
		MaxBodyBytes: cfg.Limits.MaxBodyBytes, CertTTL: time.Duration(cfg.Join.CertTTLSeconds) * time.Second, DownloadsDir: cfg.Downloads.Dir,
		Attestors: cfg.Join.Attestors, TPMPools: tpmPools, SVIDForm: cfg.Join.SVIDForm,
		JoinRequestLimits: join.RequestLimits{MaxPendingPerPool: cfg.Join.MaxPendingRequestsPerPool, MaxPendingPerSource: cfg.Join.MaxPendingRequestsPerSource},
		JoinVouchWait:     cfg.Join.VouchWait,
		HeartbeatMAC:      cfg.Session.MAC(),
		Metrics:           m})
	if err != nil {
		return nil, err
	}
	if _, created, err := srv.Tenancy().Bootstrap(ctx, cfg.RootTenant); err != nil {
		return nil, fmt.Errorf("bootstrap root tenant: %w", err)
	} else if created {
		log.Info("created root tenant", "name", cfg.RootTenant)
	}
	if o.Setup != nil {
		if err := o.Setup(ctx, srv, db); err != nil {
			return nil, err
		}
	}
	return srv, nil
}

// listenMetrics listens on cfg.Metrics.Listen for Prometheus metrics,
// /livez and /readyz (and pprof when configured); nil when none is
// configured.
func listenMetrics(cfg Config, o Options, log *slog.Logger, reg *prometheus.Registry, srv *api.Server) (*http.Server, net.Listener, error) {
	if cfg.Metrics.Listen == "" {
		return nil, nil, nil
	}
	mln, err := net.Listen("tcp", cfg.Metrics.Listen)
	if err != nil {
		return nil, nil, errs.New(errs.InvalidConfig, "metrics listen %s: %v", cfg.Metrics.Listen, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// The same health as the gateway's and bcd's listeners (R17.2): a
	// probe needs no route to the API's own listener.
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.Handle("GET /readyz", srv.ReadyHandler())
	if cfg.Metrics.Pprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	}
	ms := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	log.Info("metrics listening", "addr", mln.Addr().String())
	if o.MetricsReady != nil {
		o.MetricsReady(mln.Addr().String())
	}
	return ms, mln, nil
}

// listenAgent listens for the agent listener (gateways, mTLS from the
// serving CA); nil when none is configured. Its net/http error lines
// (handshake failures) go through errLog.
func listenAgent(cfg Config, o Options, log *slog.Logger, srv *api.Server, bundle *ca.Bundle, errLog *ratelimit.Logger) (*http.Server, net.Listener, error) {
	if cfg.Agent.Listen == "" && o.AgentCert == nil {
		return nil, nil, nil
	}
	if bundle == nil {
		return nil, nil, errs.New(errs.InvalidConfig, "the agent listener needs the machine PKI (pki.dir)")
	}
	cert := o.AgentCert
	if cert == nil {
		c, err := tls.LoadX509KeyPair(cfg.Agent.CertFile, cfg.Agent.KeyFile)
		if err != nil {
			return nil, nil, errs.New(errs.InvalidConfig, "agent certificate: %v", err)
		}
		cert = &c
	}
	addr := cfg.Agent.Listen
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	aln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, errs.New(errs.InvalidConfig, "agent listen %s: %v", addr, err)
	}
	as := &http.Server{
		Handler:           srv.AgentHandler(),
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      60 * time.Second,
		IdleTimeout:       10 * time.Minute,
		MaxHeaderBytes:    32 << 10,
		TLSConfig:         agentTLS(cfg, bundle, cert, o.AgentCert == nil, log),
		ErrorLog:          errLog.ErrorLog(slog.LevelWarn, "agent"),
		// A gateway multiplexes its nodes' long-lived session streams
		// over a few connections: the default of 250 streams per
		// connection would make it dial a connection per 250 nodes.
		// 16 KiB frames (the HTTP/2 minimum) because the Go client holds
		// a scratch buffer of the peer's frame size (up to 512 KiB) for
		// each stream whose body is still open, i.e. each session.
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:      100000,
			MaxReadFrameSize:          16 << 10,
			MaxReceiveBufferPerStream: 256 << 10,
			SendPingTimeout:           60 * time.Second,
			PingTimeout:               20 * time.Second,
		},
	}
	log.Info("agent listener (gateways, mTLS)", "addr", aln.Addr().String())
	if o.AgentReady != nil {
		o.AgentReady(aln.Addr().String())
	}
	return as, aln, nil
}

// background is serve's background work, each task run until its context
// ends: the controller, command expiry, the commands listener, the loop
// that wakes the controller on commits, the export of events and audit
// rows when [export] names sinks, the console's sweep of expired sessions
// and the following of the PKI's keys. serve stops them after the servers
// and before the store closes (the controller releases its lease when it
// stops).
func background(exp export.Config, db *store.DB, srv *api.Server, ring *rotation.Ring, log *slog.Logger) []func(context.Context) {
	ctrl := controller.New(controller.Config{DB: db, Log: log, Hub: srv.Hub(), Notify: srv.Sessions().Notify})
	srv.Sessions().OnResult(ctrl.Wake)
	// Commands queued on other replicas (PostgreSQL) reach this replica's
	// sessions at once: one dedicated LISTEN connection (on SQLite, one
	// process, Run returns at once).
	lst := session.NewListener(session.ListenerConfig{DB: db, Clock: clock.Real{}, Log: log, Notify: srv.Sessions().Notify})
	tasks := []func(context.Context){
		ctrl.Run,
		srv.Commands().RunExpiry, // undelivered and unanswered commands expire
		lst.Run,
		func(ctx context.Context) {
			// Wake the controller when work was queued or made due (a
			// Hello of a node awaiting acceptance, a command result), not
			// at every commit: joins no longer queue work (they adopt in
			// their own transaction), and a claim that finds nothing is a
			// write transaction for nothing.
			for {
				select {
				case <-ctx.Done():
					return
				case <-db.WorkQueued():
					ctrl.Wake()
				}
			}
		},
		func(ctx context.Context) { runExport(ctx, exp, db, srv, log) },
		srv.Console().Run, // the console drops expired sessions
	}
	if ring != nil {
		// R16.1: a rotation reaches this replica without a restart.
		tasks = append(tasks, ring.Run)
	}
	return tasks
}

// runExport exports events and audit rows to the configured sinks until
// ctx ends (R17.4). The config was checked when it was loaded
// (export.Check); what fails only now (a CA file removed since) is logged
// as an error and exports nothing.
func runExport(ctx context.Context, exp export.Config, db *store.DB, srv *api.Server, log *slog.Logger) {
	if len(exp.Sinks) == 0 {
		return
	}
	codec, err := events.NewCodec(db.StreamKey())
	if err == nil {
		exp.DB, exp.Codec, exp.Hub, exp.Log = db, codec, srv.Hub(), log
		var e *export.Exporter
		if e, err = export.New(exp); err == nil {
			log.Info("exporting events and audit rows", "sinks", len(exp.Sinks))
			e.Run(ctx)
			return
		}
	}
	log.Error("export: not exporting", "err", err)
}

// loadBundle loads the machine PKI from cfg.PKI.Dir; nil when none is
// configured (joins answer INVALID_CONFIG).
func loadBundle(cfg Config, o Options, log *slog.Logger) (*ca.Bundle, error) {
	if cfg.PKI.Dir == "" {
		log.Warn("no pki.dir: joins will answer INVALID_CONFIG until the machine PKI is configured")
		return nil, nil
	}
	if len(o.Secret) == 0 {
		return nil, errs.New(errs.InvalidConfig, "pki.dir is set but BETTER_COMPUTE_SECRET is empty: the bundle's keys cannot be decrypted")
	}
	bundle, err := ca.Load(cfg.PKI.Dir, o.Secret)
	if err != nil {
		return nil, err
	}
	if err := ca.CheckSecret(o.Secret); err != nil {
		// Key files made before the rule still open;
		// the operator learns the secret is weak at every start.
		log.Warn("the PKI's keys are encrypted with a weak secret: move to a generated one (better-compute pki generate-secret) by making a new bundle", "err", err)
	}
	log.Info("machine PKI loaded", "trust_domain", bundle.TrustDomain)
	return bundle, nil
}

// apiMetrics registers the API's request and session metrics and its
// scrape-time collectors on reg (the fleet counters were registered by
// apimetrics.NewAPI) and returns the API's handler counting requests by
// route.
func apiMetrics(reg *prometheus.Registry, srv *api.Server) http.Handler {
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reqs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.APIRequests, Help: "API requests by route (procedure or route pattern; \"other\" for no route) and status."},
		[]string{telemetry.LabelPath, telemetry.LabelCode})
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: telemetry.APIRequestSeconds, Help: "API request latency by route.", Buckets: prometheus.DefBuckets},
		[]string{telemetry.LabelPath})
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: telemetry.SessionsHeld, Help: "Node sessions this API replica holds."},
		func() float64 { return float64(srv.Sessions().Held()) })
	reg.MustRegister(reqs, dur, held)
	srv.RegisterMetrics(reg)
	return instrument(srv, srv.RouteLabel, reqs, dur)
}

// loadAPICert reads the API's certificate before anything listens: a
// missing or bad file is a config error, never a server that said it
// listens and then exits. Replaced files are served from the next
// handshake on. nil without [tls].
func loadAPICert(cfg Config, log *slog.Logger) (*certfile.Pair, error) {
	if cfg.TLS.CertFile == "" {
		return nil, nil
	}
	p, err := certfile.LoadPair(cfg.TLS.CertFile, cfg.TLS.KeyFile, nil, log)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "tls: cannot load cert_file %s and key_file %s: %v", cfg.TLS.CertFile, cfg.TLS.KeyFile, err)
	}
	return p, nil
}
