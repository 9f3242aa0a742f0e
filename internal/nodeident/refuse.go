package nodeident

import (
	"context"
	"maps"

	"github.com/better-compute/better-compute/internal/events"
	"github.com/better-compute/better-compute/internal/store"
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
func (c *Core) Refused(ctx context.Context, r Refused) {
	ctx = context.WithoutCancel(ctx)
	tenant := r.TenantID
	if tenant == "" {
		err := c.db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			tenant, err = c.RootTenant(ctx, tx)
			return err
		})
		if err != nil {
			c.log.Error("record refusal: read the root tenant", "err", err)
			return
		}
		if tenant == "" {
			// Before bootstrap there is no tenant to tell.
			c.log.Info(r.Kind+" refused", "reason", r.Reason, "recorded", false)
			return
		}
	}
	reason := r.Reason
	if r.Kind == KindJoin {
		reason = r.Attestor + ":" + r.Reason
	}
	// \x1f, not NUL: PostgreSQL text cannot hold NUL.
	key := tenant + "\x1f" + r.Kind + "\x1f" + reason
	if c.limiter.Drop(key) {
		c.log.Info(r.Kind+" refused", "reason", reason, "tenant", tenant, "node", r.NodeID, "serial", r.Serial, "recorded", false)
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
	c.log.Info(r.Kind+" refused", "reason", reason, "tenant", tenant, "node", r.NodeID, "serial", r.Serial,
		"suppressed", suppressed, "recorded", ok && err == nil)
	if err != nil {
		c.log.Error("record refusal", "kind", r.Kind, "err", err)
	}
}
