package run

import (
	"context"
	"errors"
	"time"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/nodesession"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Recovery (R19.3): what ends a session decides how soon bcd opens the
// next one.
//   - A renewal (the identity on disk has another serial, whether the
//     session saw it or the server ended the session because the renewal
//     superseded its certificate) reconnects at once with the new
//     certificate, and the backoff starts over: a renewed or new identity
//     is a fresh start.
//   - A session that ended on a certificate about to expire (the server
//     ends it at expiry) is not a failure either: bcd waits for the
//     renewal, never opening a session on a certificate that expires
//     before the next heartbeat, and exits once it expired (a session
//     cannot help then; bcd join renews it).
//   - Anything else (the gateway restarted, the API is down) is a
//     failure. The first reconnect after it waits a time drawn uniformly
//     from [0, FirstReconnectSpread): every daemon of a gateway or an API
//     that restarted lost its session in the same second, and a backoff's
//     ±20% of 1 s would bring them all back within 0.4 s. Spread over
//     10 s, the 10,000 daemons a gateway holds come back at about 1,000
//     new TLS handshakes a second, and 100,000 daemons of an API restart
//     send their Hellos at about 10,000 a second across its replicas. The
//     failures after it wait Backoff(n) with ±20% jitter (2 s, 4 s, … up
//     to 60 s), never in a hot loop (nodesession.ReconnectWait). A
//     session that stayed up nodesession.StableAfter starts over.

// lifecycleEnd reports whether a session that ended with err, opened on
// id, ended for its certificate's life cycle (renewed, or about to
// expire) rather than a failure.
func (d *Daemon) lifecycleEnd(id *identity.Identity, err error) bool {
	if errors.Is(err, errIdentityChanged) || d.expiresSoon(id) {
		return true
	}
	cur, lerr := d.cfg.Store.Load()
	return lerr == nil && cur.Serial != id.Serial
}

// expiresSoon reports whether id expires before the next heartbeat: a
// session opened on it would end at once. The margin is at most a quarter
// of the certificate's lifetime, so a heartbeat as long as a short
// certificate never keeps bcd from connecting (the renewer renews by 75%).
func (d *Daemon) expiresSoon(id *identity.Identity) bool {
	return id.NotAfter.Sub(d.serverTime.Now()) < d.expiryMargin(id)
}

// expiryMargin is how long before its expiry a certificate opens no
// session.
func (d *Daemon) expiryMargin(id *identity.Identity) time.Duration {
	margin := d.beatOrDefault()
	if leaf := id.Leaf(); leaf != nil {
		margin = min(margin, leaf.NotAfter.Sub(leaf.NotBefore)/4)
	}
	return margin
}

// beatOrDefault is the heartbeat interval the last Welcome named, or the
// default before any.
func (d *Daemon) beatOrDefault() time.Duration {
	if d.beat > 0 {
		return d.beat
	}
	return nodesession.DefaultHeartbeat
}

// awaitUsable returns id, or once id expires before the next heartbeat
// the renewed identity the renewer saves meanwhile. It re-reads the
// identity when Renewed says so, every IdentityCheck, and at expiry, when
// it returns the expiry error.
func (d *Daemon) awaitUsable(ctx context.Context, id *identity.Identity) (*identity.Identity, error) {
	for logged := false; d.expiresSoon(id); logged = true {
		if !logged {
			d.log.Warn("the certificate expires before the next heartbeat: waiting for its renewal before opening a session",
				telemetry.LogNotAfter, id.NotAfter.UTC().Format(time.RFC3339), telemetry.LogMargin, d.expiryMargin(id).String())
		}
		// At least a second, so a clock at the very expiry cannot spin.
		wait := max(min(d.cfg.IdentityCheck, id.NotAfter.Sub(d.serverTime.Now())), time.Second)
		if !d.sleepOrRenewed(ctx, wait) {
			return nil, ctx.Err()
		}
		next, err := d.usable(ctx)
		if err != nil {
			return nil, err
		}
		id = next
	}
	return id, nil
}

// sleepOrRenewed waits wait on the clock, or less when Renewed says a new
// identity was saved (it is used at once). It reports false when ctx ended.
func (d *Daemon) sleepOrRenewed(ctx context.Context, wait time.Duration) bool {
	t := d.clock.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C():
	case <-d.cfg.Renewed:
	}
	return true
}
