package run

import (
	"context"
	"crypto/tls"
	"net/url"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Pin continuity (R16.2) in the session: the keys a Welcome vouches for, and
// the way back when the gateway's serving CA was rotated while this node was
// offline. Kept apart from the session loop.

// livePins returns the daemon's live pin sets: Config.Pins, or BCD's kept
// in memory.
func livePins(cfg Config) *config.Pins {
	if cfg.Pins != nil {
		return cfg.Pins
	}
	return config.NewPins("", cfg.BCD, cfg.Log)
}

// learnWelcome applies a Welcome's key statements. The Welcome came over the
// pinned session, but that proves nothing of the statements: only those a
// pinned key signed count (pki.ApplyStatements). A failure to save them is
// logged by Learn; the session goes on.
func (d *Daemon) learnWelcome(w *agentv1.Welcome) {
	_, _ = d.pins.Learn("welcome", w.GetKeyStatements())
}

// notePinFailure wraps the pinned verification so the daemon knows a
// session failed on the gateway's chain (the session's error no longer
// carries enroll's pin error once mapped).
func (d *Daemon) notePinFailure(tc *tls.Config) {
	verify := tc.VerifyConnection
	tc.VerifyConnection = func(cs tls.ConnectionState) error {
		err := verify(cs)
		if _, ok := enroll.PinFailure(err); ok {
			d.pinFailed.Store(true)
		}
		return err
	}
}

// sessionRecovering is session, once more when it failed on the gateway's
// chain and the gateway's Keys answer carried a serving CA a pinned key
// vouched for (enroll.RecoverPins): never more than once per failure.
func (d *Daemon) sessionRecovering(ctx context.Context, id *identity.Identity) error {
	d.pinFailed.Store(false)
	err := d.session(ctx, id)
	if err == nil || ctx.Err() != nil || !d.pinFailed.Load() {
		return err
	}
	u, perr := url.Parse(d.cfg.BCD.GatewayURL)
	if perr != nil {
		return err
	}
	serverName := d.cfg.BCD.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	hc := d.cfg.HTTPClient
	if hc == nil {
		hc = enroll.DefaultHTTPClient
	}
	if !enroll.RecoverPins(ctx, d.pins, hc, d.cfg.BCD.GatewayURL, serverName, d.log) {
		return err
	}
	d.pinFailed.Store(false)
	return d.session(ctx, id)
}

// servingCAPins is the serving-CA set the next dial verifies against.
func (d *Daemon) servingCAPins() []string { return d.pins.Set(pki.KindServingCA) }
