// Package diag is bcd's diagnostics listener ([diagnostics] listen in
// config.toml, off by default): /livez, /readyz (the identity loaded and
// unexpired, the last renewal not failed, the session up; the reason when
// not) and /metrics (renewals, session reconnects, seconds until the node
// certificate expires).
//
// It learns what the daemon does from bcd run's hooks: the session's
// OnWelcome and OnSessionEnded, the renewer's OnRenewed and OnFailed.
package diag

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// DefaultListen is the address the docs and the Kubernetes manifests use.
const DefaultListen = "127.0.0.1:9464"

// Config is the [diagnostics] section of bcd's config.toml.
type Config struct {
	// Listen is host:port, e.g. "127.0.0.1:9464"; empty serves nothing.
	Listen string `toml:"listen,omitempty"`
	// AllowNonLoopback lets Listen be an address other machines reach
	// (readiness names the node's state; metrics its certificate's
	// lifetime). Off: only loopback addresses are accepted.
	AllowNonLoopback bool `toml:"allow_non_loopback,omitempty"`
}

// Problem is what is wrong with c.Listen ("" when nothing): it must be
// host:port on a loopback host unless AllowNonLoopback.
func (c Config) Problem() string {
	if c.Listen == "" {
		return ""
	}
	host, _, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return fmt.Sprintf("%q: want host:port, e.g. %s", c.Listen, DefaultListen)
	}
	if c.AllowNonLoopback || host == "localhost" {
		return ""
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return fmt.Sprintf("%q is not a loopback address; use %s, or set diagnostics.allow_non_loopback = true", c.Listen, DefaultListen)
	}
	return ""
}

// Diag tracks the daemon's state and serves it. Build it with New.
type Diag struct {
	load func() (*identity.Identity, error) // the store's Load
	now  func() time.Time

	mu          sync.Mutex
	sessionUp   bool
	welcomed    bool
	sessionErr  string
	renewFailed string // the last renewal's failure; "" after a success
	renewals    *prometheus.CounterVec
	reconnects  prometheus.Counter
	reg         *prometheus.Registry
}

// New returns a Diag reading the identity from store and dating by now
// (bcd passes its control-plane time, internal/node/servertime, so that it
// calls a certificate expired when bcd's renewer does); nil: the real clock.
func New(store *identity.Store, now func() time.Time) *Diag {
	if now == nil {
		now = clock.Real{}.Now
	}
	d := &Diag{load: store.Load, now: now, reg: prometheus.NewRegistry()}
	d.renewals = prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.NodeRenewals, Help: "Certificate renewals by outcome (ok, failed)."},
		[]string{telemetry.LabelOutcome})
	d.renewals.WithLabelValues(telemetry.OutcomeOK)
	d.renewals.WithLabelValues(telemetry.OutcomeFailed)
	d.reconnects = prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.NodeSessionReconnects, Help: "Sessions opened after the first (each a reconnect)."})
	expiry := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: telemetry.NodeCertExpiry, Help: "Seconds until the node certificate expires (negative: expired; absent without an identity)."},
		func() float64 {
			id, err := d.load()
			if err != nil {
				return 0
			}
			return id.NotAfter.Sub(d.now()).Seconds()
		})
	d.reg.MustRegister(d.renewals, d.reconnects, expiry)
	return d
}

// Registry is bcd's metrics registry.
func (d *Diag) Registry() *prometheus.Registry { return d.reg }

// Welcomed records a session opened (run.Config.OnWelcome).
func (d *Diag) Welcomed(string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.welcomed {
		d.reconnects.Inc()
	}
	d.welcomed, d.sessionUp, d.sessionErr = true, true, ""
}

// Renewed records a renewal that succeeded (renew.Config.OnRenewed).
func (d *Diag) Renewed(*identity.Identity) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.renewFailed = ""
	d.renewals.WithLabelValues(telemetry.OutcomeOK).Inc()
}

// RenewalFailed records a renewal that failed (renew.Config.OnFailed).
func (d *Diag) RenewalFailed(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.renewFailed = d.now().UTC().Format(time.RFC3339) + ": " + errText(err)
	d.renewals.WithLabelValues(telemetry.OutcomeFailed).Inc()
}

// SessionEnded records a session that ended (run.Config.OnSessionEnded).
func (d *Diag) SessionEnded(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sessionUp, d.sessionErr = false, errText(err)
}

func errText(err error) string {
	if err == nil {
		return "ended"
	}
	return err.Error()
}

// NotReady is why the node is not ready, "" when it is (R17.2).
func (d *Diag) NotReady() string {
	id, err := d.load()
	if err != nil {
		return "no identity: " + err.Error()
	}
	if now := d.now(); !now.Before(id.NotAfter) {
		return fmt.Sprintf("the node certificate expired at %s", id.NotAfter.UTC().Format(time.RFC3339))
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.renewFailed != "" {
		return "the last renewal failed at " + d.renewFailed
	}
	if !d.sessionUp {
		if d.sessionErr != "" {
			return "no session to the gateway: " + d.sessionErr
		}
		return "no session to the gateway yet"
	}
	return ""
}

// Handler serves /livez, /readyz and /metrics.
func (d *Diag) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(d.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /livez", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if reason := d.NotReady(); reason != "" {
			http.Error(w, "not ready: "+reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// Listen opens c.Listen (refused when Problem names one) for Serve; nil,
// with nothing to serve, when c.Listen is empty.
func (d *Diag) Listen(c Config) (net.Listener, error) {
	if c.Listen == "" {
		return nil, nil
	}
	if p := c.Problem(); p != "" {
		return nil, errs.New(errs.InvalidConfig, "diagnostics.listen: %s", p)
	}
	ln, err := net.Listen("tcp", c.Listen)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "diagnostics.listen %s: %v", c.Listen, err)
	}
	return ln, nil
}

// Serve serves Handler on ln until ctx ends, and returns once it stopped
// (its owner waits for it); ready, when set, receives the address.
func (d *Diag) Serve(ctx context.Context, ln net.Listener, log *slog.Logger, ready func(addr string)) error {
	hs := &http.Server{Handler: d.Handler(), ReadHeaderTimeout: 5 * time.Second}
	defer context.AfterFunc(ctx, func() { _ = hs.Close() })()
	log.Info("diagnostics listening", telemetry.LogAddr, ln.Addr().String())
	if ready != nil {
		ready(ln.Addr().String())
	}
	if err := hs.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("diagnostics listener: %w", err)
	}
	return nil
}
