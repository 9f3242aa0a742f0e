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

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Diag tracks the daemon's state and serves it. Build it with New.
type Diag struct {
	load func() (*identity.Identity, error) // the store's Load
	now  func() time.Time

	mu          sync.Mutex
	sessionUp   bool
	welcomed    bool
	sessionErr  string
	renewFailed string // the last renewal's failure; "" after a success
	// The metrics' counters (metrics.go).
	renewedOK, renewFailures, reconnects uint64
}

// New returns a Diag reading the identity from store and dating by now
// (bcd passes its control-plane time, internal/node/servertime, so that it
// calls a certificate expired when bcd's renewer does); nil: the real clock.
func New(store *identity.Store, now func() time.Time) *Diag {
	if now == nil {
		now = clock.Real{}.Now
	}
	return &Diag{load: store.Load, now: now}
}

// Welcomed records a session opened (run.Config.OnWelcome).
func (d *Diag) Welcomed(string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.welcomed {
		d.reconnects++
	}
	d.welcomed, d.sessionUp, d.sessionErr = true, true, ""
}

// Renewed records a renewal that succeeded (renew.Config.OnRenewed).
func (d *Diag) Renewed(*identity.Identity) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.renewFailed = ""
	d.renewedOK++
}

// RenewalFailed records a renewal that failed (renew.Config.OnFailed).
func (d *Diag) RenewalFailed(err error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.renewFailed = d.now().UTC().Format(time.RFC3339) + ": " + errText(err)
	d.renewFailures++
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
	mux.HandleFunc("GET /metrics", d.serveMetrics)
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
func (d *Diag) Listen(c bcdconfig.Diagnostics) (net.Listener, error) {
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
