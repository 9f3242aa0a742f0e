package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/better-compute/better-compute/internal/api"
	"github.com/better-compute/better-compute/internal/clock"
	"github.com/better-compute/better-compute/internal/controller"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/join"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/session"
	"github.com/better-compute/better-compute/internal/store"
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
	Bundle func(*pki.Bundle)
	// MetricsReady receives the metrics listener's address (listen on
	// port 0 and learn the port here).
	MetricsReady func(addr string)
}

// Run serves the API until ctx ends, then shuts down gracefully.
func Run(ctx context.Context, cfg Config, o Options) error {
	log := o.Log
	if log == nil {
		log = slog.Default()
	}
	db, err := store.Open(ctx, cfg.Store, log)
	if err != nil {
		return err
	}
	defer db.Close()

	var bundle *pki.Bundle
	if cfg.PKI.Dir != "" {
		if len(o.Secret) == 0 {
			return errs.New(errs.InvalidConfig, "pki.dir is set but BETTER_COMPUTE_SECRET is empty: the bundle's keys cannot be decrypted")
		}
		if bundle, err = pki.Load(cfg.PKI.Dir, o.Secret); err != nil {
			return err
		}
		if err := pki.CheckSecret(o.Secret); err != nil {
			// Key files made before the rule still open (issue 8 point 5);
			// the operator learns the secret is weak at every start.
			log.Warn("the PKI's keys are encrypted with a weak secret: move to a generated one (better-compute pki generate-secret) by making a new bundle", "err", err)
		}
		log.Info("machine PKI loaded", "trust_domain", bundle.TrustDomain)
	} else {
		log.Warn("no pki.dir: joins will answer INVALID_CONFIG until the machine PKI is configured")
	}
	var gw *api.GatewayInfo
	if cfg.Gateway.URL != "" {
		gw = &api.GatewayInfo{URL: cfg.Gateway.URL, ServerName: cfg.Gateway.ServerName}
	}
	if o.Bundle != nil {
		o.Bundle(bundle)
	}
	tpmPools, err := cfg.Join.TPM.AttestorPools()
	if err != nil {
		return err
	}
	srv, err := api.New(api.Config{DB: db, Clock: clock.Real{}, Log: log, BasePath: cfg.BasePath, Bundle: bundle, Gateway: gw,
		MaxBodyBytes: cfg.Limits.MaxBodyBytes, CertTTL: time.Duration(cfg.Join.CertTTLSeconds) * time.Second, DownloadsDir: cfg.Downloads.Dir,
		Attestors: cfg.Join.Attestors, TPMPools: tpmPools,
		JoinRequestLimits: join.RequestLimits{MaxPendingPerPool: cfg.Join.MaxPendingRequestsPerPool, MaxPendingPerSource: cfg.Join.MaxPendingRequestsPerSource}})
	if err != nil {
		return err
	}
	if _, created, err := srv.Tenancy().Bootstrap(ctx, cfg.RootTenant); err != nil {
		return fmt.Errorf("bootstrap root tenant: %w", err)
	} else if created {
		log.Info("created root tenant", "name", cfg.RootTenant)
	}
	if o.Setup != nil {
		if err := o.Setup(ctx, srv, db); err != nil {
			return err
		}
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reqs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "bc_api_requests_total", Help: "API requests by route (procedure or route pattern; \"other\" for no route) and status."}, []string{"path", "code"})
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "bc_api_request_seconds", Help: "API request latency by route.", Buckets: prometheus.DefBuckets}, []string{"path"})
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "bc_sessions_held", Help: "Node sessions this API replica holds."},
		func() float64 { return float64(srv.Sessions().Held()) })
	reg.MustRegister(reqs, dur, held)
	handler := instrument(srv, srv.RouteLabel, reqs, dur)

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return errs.New(errs.InvalidConfig, "listen %s: %v", cfg.Listen, err)
	}
	hs := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       cfg.Limits.read(),
		WriteTimeout:      cfg.Limits.write(),
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	errc := make(chan error, 2)
	go func() {
		var err error
		if cfg.TLS.CertFile != "" {
			err = hs.ServeTLS(ln, cfg.TLS.CertFile, cfg.TLS.KeyFile)
		} else {
			err = hs.Serve(ln)
		}
		if !errors.Is(err, http.ErrServerClosed) {
			errc <- err
		}
	}()
	var ms *http.Server
	if cfg.Metrics.Listen != "" {
		mln, err := net.Listen("tcp", cfg.Metrics.Listen)
		if err != nil {
			hs.Close()
			return errs.New(errs.InvalidConfig, "metrics listen %s: %v", cfg.Metrics.Listen, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		if cfg.Metrics.Pprof {
			mux.HandleFunc("/debug/pprof/", pprof.Index)
			mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		}
		ms = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := ms.Serve(mln); !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
		log.Info("metrics listening", "addr", mln.Addr().String())
		if o.MetricsReady != nil {
			o.MetricsReady(mln.Addr().String())
		}
	}
	var as *http.Server
	if cfg.Agent.Listen != "" || o.AgentCert != nil {
		if bundle == nil {
			hs.Close()
			return errs.New(errs.InvalidConfig, "the agent listener needs the machine PKI (pki.dir)")
		}
		cert := o.AgentCert
		if cert == nil {
			c, err := tls.LoadX509KeyPair(cfg.Agent.CertFile, cfg.Agent.KeyFile)
			if err != nil {
				hs.Close()
				return errs.New(errs.InvalidConfig, "agent certificate: %v", err)
			}
			cert = &c
		}
		cas := x509.NewCertPool()
		cas.AddCert(bundle.ServingCA)
		addr := cfg.Agent.Listen
		if addr == "" {
			addr = "127.0.0.1:0"
		}
		aln, err := net.Listen("tcp", addr)
		if err != nil {
			hs.Close()
			return errs.New(errs.InvalidConfig, "agent listen %s: %v", addr, err)
		}
		as = &http.Server{
			Handler:           srv.AgentHandler(),
			ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout:       30 * time.Second,
			WriteTimeout:      60 * time.Second,
			IdleTimeout:       10 * time.Minute,
			MaxHeaderBytes:    32 << 10,
			TLSConfig: &tls.Config{
				MinVersion:   tls.VersionTLS12,
				Certificates: []tls.Certificate{*cert},
				ClientAuth:   tls.RequireAndVerifyClientCert,
				ClientCAs:    cas,
				NextProtos:   []string{"h2", "http/1.1"},
			},
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
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
		go func() {
			if err := as.ServeTLS(aln, "", ""); !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
		log.Info("agent listener (gateways, mTLS)", "addr", aln.Addr().String())
		if o.AgentReady != nil {
			o.AgentReady(aln.Addr().String())
		}
	}
	ctrl := controller.New(controller.Config{DB: db, Log: log, Hub: srv.Hub(), Notify: srv.Sessions().Notify})
	srv.Sessions().OnResult(ctrl.Wake)
	cctx, cstop := context.WithCancel(ctx)
	defer cstop()
	// The controller releases its lease when it stops: wait for it before
	// the store closes.
	ctrlDone := make(chan struct{})
	go func() { defer close(ctrlDone); ctrl.Run(cctx) }()
	defer func() { cstop(); <-ctrlDone }()
	go srv.Commands().RunExpiry(cctx) // undelivered and unanswered commands expire
	// Commands queued on other replicas (PostgreSQL) reach this replica's
	// sessions at once: one dedicated LISTEN connection (on SQLite, one
	// process, Run returns at once). It stops before the store closes.
	lst := session.NewListener(session.ListenerConfig{DB: db, Clock: clock.Real{}, Log: log, Notify: srv.Sessions().Notify})
	lstDone := make(chan struct{})
	go func() { defer close(lstDone); lst.Run(cctx) }()
	defer func() { cstop(); <-lstDone }()
	go func() {
		// Wake the controller whenever events commit (a join queues work).
		for {
			select {
			case <-cctx.Done():
				return
			case <-srv.Hub().Wait():
				ctrl.Wake()
			}
		}
	}()

	scheme := "http"
	if cfg.TLS.CertFile != "" {
		scheme = "https"
	}
	log.Info("API listening", "url", fmt.Sprintf("%s://%s%s", scheme, ln.Addr(), srv.BasePath()))
	if o.Ready != nil {
		o.Ready(ln.Addr().String())
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if ms != nil {
		_ = ms.Shutdown(sctx)
	}
	if as != nil {
		// Sessions outlive any graceful wait: end them (their daemons
		// reconnect through another replica) and let each write its
		// disconnect before the database closes.
		_ = srv.Sessions().Close(sctx)
		_ = as.Shutdown(sctx)
	}
	return hs.Shutdown(sctx)
}

type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(c int) { w.code = c; w.ResponseWriter.WriteHeader(c) }

func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// instrument counts and times requests by route. The label comes from
// label (api.Server.RouteLabel): a bounded set decided by the route table,
// never the raw path, because it is taken before authentication (issue 8
// point 1). The status code is bounded by http.Server (three digits).
func instrument(h http.Handler, label func(*http.Request) string, reqs *prometheus.CounterVec, dur *prometheus.HistogramVec) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		route := label(r) // before serving: handlers may rewrite r.URL
		sw := &statusWriter{ResponseWriter: w, code: 200}
		h.ServeHTTP(sw, r)
		reqs.WithLabelValues(route, strconv.Itoa(sw.code)).Inc()
		dur.WithLabelValues(route).Observe(time.Since(start).Seconds())
	})
}
