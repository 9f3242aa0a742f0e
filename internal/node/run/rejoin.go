package run

import (
	"context"
	"time"

	"github.com/better-compute/better-compute/internal/node/doctor"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Coming back by itself (R21.5): a certificate that expired while bcd was
// stopped or cut off cannot be renewed, but its key still proves the node
// to the x509pop attestor within its window. bcd run re-joins by itself,
// says so, and only when that fails stops with the command a person runs.

// usable loads the identity; an expired one is re-joined by x509pop when
// Config.Rejoin is set. The identity counts as expired only when this
// machine's clock agrees with the control plane's as bcd knows it
// (servertime.Expired), so no offset makes a valid certificate look
// expired.
func (d *Daemon) usable(ctx context.Context) (*identity.Identity, error) {
	id, err := d.cfg.Store.Load()
	if err != nil {
		return nil, err
	}
	if !d.serverTime.Expired(id.NotAfter) {
		return id, nil
	}
	if d.cfg.Rejoin == nil {
		return nil, errs.New(errs.InvalidState, "%s", doctor.ExpiredMessage(id.NotAfter))
	}
	d.log.Warn("the certificate expired: re-joining as the same node by x509pop (its key proves the node)",
		telemetry.LogNodeID, id.NodeID, telemetry.LogNotAfter, id.NotAfter.UTC().Format(time.RFC3339))
	next, err := d.cfg.Rejoin(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, errs.New(errs.InvalidState,
			"the certificate expired at %s and re-joining by x509pop failed: %s. If the control plane does not run the x509pop attestor, or the certificate expired more than 7 days ago, join again as root: bcd join --reset --yes, then bcd join",
			id.NotAfter.UTC().Format(time.RFC3339), errs.MessageOf(err))
	}
	d.log.Info("re-joined by x509pop", telemetry.LogNodeID, next.NodeID, telemetry.LogSerial, next.Serial,
		telemetry.LogNotAfter, next.NotAfter.UTC().Format(time.RFC3339))
	select {
	case d.rejoined <- struct{}{}:
	default:
	}
	return next, nil
}

// renewLoop runs the renewer until ctx ends. The renewer stops on an
// identity it cannot renew (expired); after a re-join saved a new one it
// starts again.
func (d *Daemon) renewLoop(ctx context.Context) {
	for {
		err := d.cfg.Renewer.Loop(ctx)
		if ctx.Err() != nil {
			return
		}
		d.log.Error("certificate renewal stopped", telemetry.LogErr, err)
		select {
		case <-ctx.Done():
			return
		case <-d.rejoined:
			d.log.Info("renewing the re-joined identity")
		}
	}
}
