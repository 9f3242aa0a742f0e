package nodeident

import (
	"context"
	"log/slog"
	"maps"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Kinds of refusal, each its own event type security.<kind>.refused.
const (
	KindJoin    = "join"
	KindRenew   = "renew"
	KindSession = "session"
)

// Refused is a refusal to record.
type Refused struct {
	// Kind is KindJoin, KindRenew or KindSession.
	Kind string
	// Attestor names the join attestor (joins only; its reason is recorded
	// as <attestor>:<reason>, R4.7).
	Attestor string
	*Refusal
	// Data adds fields to the event (role, csrSha256, hardwareKey, peer,
	// ...): hashes and names only, never a secret.
	Data map[string]any
	// Peer is the caller's address for the log line; empty: the one
	// WithPeer put in the context.
	Peer string
}

type peerKey struct{}

// WithPeer returns ctx naming the caller's address (as the gateway
// forwarded it), for the log line of a refusal recorded under ctx.
func WithPeer(ctx context.Context, addr string) context.Context {
	return context.WithValue(ctx, peerKey{}, addr)
}

// peer is the address for the log line, at most 64 bytes: it is what the
// gateway forwarded, not something the API checked.
func (r Refused) peer(ctx context.Context) string {
	p := r.Peer
	if p == "" {
		p, _ = ctx.Value(peerKey{}).(string)
	}
	if len(p) > 64 {
		p = p[:64]
	}
	return p
}

// Refused records a refusal (R4.7, R13.5) as a security.<kind>.refused
// event in its own transaction (the refused one rolled back, and the caller
// may have hung up), to the refusal's tenant or, when it names none, the
// root tenant.
//
// Events are rate-limited to 60 per minute per tenant, kind, attestor and
// reason across every API replica on the database (events.Limiter), and
// each event's `suppressed` counts that key's events dropped
// since its last one. SECURITY: the key includes the tenant, so refusals
// one tenant causes never suppress, hide or count another tenant's.
//
// Log lines are rate-limited by the same key in this process (LogLimiter:
// 10 a minute by default, R15.4): a flood of refusals is a few lines, each
// naming the peer and saying how many of the key's lines were suppressed.
func (c *Core) Refused(ctx context.Context, r Refused) {
	ctx = context.WithoutCancel(ctx)
	peer := r.peer(ctx)
	tenant := r.TenantID
	if tenant == "" {
		err := c.db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			tenant, err = c.RootTenant(ctx, tx)
			return err
		})
		if err != nil {
			c.lines.LogContext(ctx, slog.LevelError, "\x1froot-tenant", "record refusal: read the root tenant", "err", err)
			return
		}
		if tenant == "" {
			// Before bootstrap there is no tenant to tell.
			c.lines.LogContext(ctx, slog.LevelInfo, "\x1f"+r.Kind+"\x1f"+r.Reason, r.Kind+" refused", telemetry.LogReason, r.Reason, telemetry.LogPeer, peer, "recorded", false)
			return
		}
	}
	reason := r.Reason
	if r.Kind == KindJoin {
		reason = r.Attestor + ":" + r.Reason
	}
	// \x1f, not NUL: PostgreSQL text cannot hold NUL.
	key := tenant + "\x1f" + r.Kind + "\x1f" + reason
	line := func(recorded bool) {
		c.lines.LogContext(ctx, slog.LevelInfo, key, r.Kind+" refused", telemetry.LogReason, reason, telemetry.LogTenant, tenant, telemetry.LogNodeID, r.NodeID, "serial", r.Serial,
			"peer", peer, "recorded", recorded)
	}
	if c.limiter.Drop(key) {
		c.cfg.Metrics.Suppressed(r.Kind)
		line(false)
		return
	}
	var ok bool
	var suppressed int
	err := c.db.WithTx(ctx, func(tx *store.Tx) error {
		// The limiter counts in this transaction (shared by every
		// replica), so the count and the event commit together.
		var err error
		ok, suppressed, err = c.limiter.Allow(ctx, tx, key)
		if err != nil || !ok {
			return err
		}
		data := map[string]any{"reason": reason, "suppressed": suppressed}
		if r.Kind == KindJoin {
			data["attestor"] = r.Attestor
		}
		if r.NodeID != "" {
			data["nodeId"] = r.NodeID
		}
		if r.Serial != "" {
			data["certSerial"] = r.Serial
		}
		maps.Copy(data, r.Data)
		subject := r.NodeID
		if r.Kind == KindJoin && subject == "" {
			subject = r.Attestor
		}
		return events.Publish(ctx, tx, c.cfg.Hub, events.Event{TenantID: tenant, Type: "security." + r.Kind + ".refused", Subject: subject, Data: data})
	})
	if !ok && err == nil {
		c.cfg.Metrics.Suppressed(r.Kind)
	}
	line(ok && err == nil)
	if err != nil {
		c.lines.LogContext(ctx, slog.LevelError, key+"\x1ferror", "record refusal", "kind", r.Kind, "err", err)
	}
}
