package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// MetricsConfig is the gateway's [metrics] section, named as the API's:
// a listener serving /metrics, /livez and /readyz (off when empty).
type MetricsConfig struct {
	Listen string `toml:"listen"`
}

// metrics are the gateway's series (telemetry names). Relay errors are
// pre-curried per upstream (upstream.relayErrors).
type metrics struct {
	reg        *prometheus.Registry
	opened     prometheus.Counter
	relayErrs  *prometheus.CounterVec
	upstreamUp *prometheus.GaugeVec
}

func (g *Gateway) newMetrics() {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.opened = prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.GatewaySessionsOpened, Help: "Node sessions this gateway opened toward the API."})
	m.relayErrs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.GatewayRelayErrors,
		Help: "Relayed calls and sessions that failed on an API replica without its answer (no connection, a timeout, a broken stream), by upstream."},
		[]string{telemetry.LabelUpstream})
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: telemetry.GatewaySessionsHeld, Help: "Node sessions this gateway relays now."},
		func() float64 { return float64(len(g.held)) })
	up := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: telemetry.GatewayUpstreamUp,
		Help: "1 while the gateway sends to an API replica, 0 while its health checks keep it out."}, []string{telemetry.LabelUpstream})
	m.upstreamUp = up
	expiry := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: telemetry.GatewayCertExpiry, Help: "Seconds until the gateway's serving certificate expires."},
		func() float64 { return g.pair.Get().Leaf.NotAfter.Sub(g.clock.Now()).Seconds() })
	// The Go and process collectors from the prometheus package itself:
	// its collectors package also holds a database/sql collector, and the
	// gateway links no database code (internal/checks/deptest).
	//lint:ignore SA1019 the same collectors, without database/sql linked in
	m.reg.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}),

		m.opened, m.relayErrs, held, expiry, prometheus.CollectorFunc(func(ch chan<- prometheus.Metric) {
			for _, u := range g.ups {
				v := 1.0
				if u.down.Load() {
					v = 0
				}
				up.WithLabelValues(u.base).Set(v)
			}
			up.Collect(ch)
		}))
	for _, u := range g.ups {
		u.relayErrors = m.relayErrs.WithLabelValues(u.base)
	}
	g.metrics = m
}

// relayError counts a call or session that failed on u without the API's
// answer.
func (g *Gateway) relayError(u *upstream) {
	if u != nil && u.relayErrors != nil {
		u.relayErrors.Inc()
	}
}

// Registry is the gateway's metrics registry (tests gather it).
func (g *Gateway) Registry() *prometheus.Registry { return g.metrics.reg }

// DiagnosticsHandler serves /metrics, /livez and /readyz.
func (g *Gateway) DiagnosticsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if reason := g.notReady(r.Context()); reason != "" {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// notReady is why the gateway should not get daemons ("" when ready, R17.2):
// its serving certificate is outside its validity, or no API replica
// answers its /readyz within the health timeout.
func (g *Gateway) notReady(ctx context.Context) string {
	leaf := g.pair.Get().Leaf
	if now := g.clock.Now(); now.Before(leaf.NotBefore) || !now.Before(leaf.NotAfter) {
		return fmt.Sprintf("the serving certificate is valid from %s to %s", leaf.NotBefore.UTC().Format(time.RFC3339), leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	ctx, cancel := context.WithTimeout(ctx, healthTimeout)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	var fails []string
	ok := false
	for _, u := range g.ups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := probe(ctx, u)
			mu.Lock()
			defer mu.Unlock()
			if err == nil {
				ok = true
			} else {
				fails = append(fails, u.base+": "+err.Error())
			}
		}()
	}
	wg.Wait()
	if ok {
		return ""
	}
	return "no API replica is reachable (" + strings.Join(fails, "; ") + ")"
}

// probe asks u's /readyz over its join connection.
func probe(ctx context.Context, u *upstream) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.base+"/readyz", nil)
	if err != nil {
		return err
	}
	res, err := u.http.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 1<<10))
	if res.StatusCode != http.StatusOK {
		return errors.New(res.Status)
	}
	return nil
}

// serveDiagnostics serves DiagnosticsHandler on cfg.Metrics.Listen until
// Shutdown, as one of the gateway's tasks; nothing when none is
// configured.
func (g *Gateway) serveDiagnostics() error {
	if g.cfg.Metrics.Listen == "" {
		return nil
	}
	ln, err := net.Listen("tcp", g.cfg.Metrics.Listen)
	if err != nil {
		return badKey("metrics.listen", "listen %s: %v", g.cfg.Metrics.Listen, err)
	}
	ds := &http.Server{Handler: g.DiagnosticsHandler(), ReadHeaderTimeout: 5 * time.Second}
	g.ds.Store(ds)
	if !g.tasks.Go(func() {
		if err := ds.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			g.log.Error("gateway metrics listener stopped", telemetry.LogErr, err)
		}
	}) {
		return ln.Close() // Shutdown came first
	}
	g.log.Info("gateway metrics listening", "addr", ln.Addr().String())
	if g.metricsReady != nil {
		g.metricsReady(ln.Addr().String())
	}
	return nil
}
