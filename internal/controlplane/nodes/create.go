package nodes

import (
	"context"
	"errors"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/dnsname"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// CreateRequest is nodes.create: a node made ahead of its machine.
type CreateRequest struct {
	TenantID string
	PoolID   string
	// Hostname is optional; the machine's own replaces it when it joins.
	Hostname string
	// IdempotencyKey, when set, makes a retried create answer the node
	// the first one made (unique per tenant).
	IdempotencyKey string
}

// Create makes a node ahead of its machine: a deploy
// creates it, then puts its id in the machine's user data for bcd join
// --node-id, which binds the machine to it (store.BindPendingNode). The
// node is pending at identity generation 0, with no hardware key, no
// certificate and no session until then. It is decided on the pool
// (compute:nodes:create) and publishes node.created with an audit row.
// A replayed idempotency key answers the node it made, unchanged and
// without another event; the same key for another pool or hostname is a
// CONFLICT.
func (s *Service) Create(ctx context.Context, p authz.Principal, r CreateRequest) (store.Node, error) {
	if err := p.ActFor(r.TenantID); err != nil {
		return store.Node{}, err
	}
	if r.Hostname != "" && !dnsname.Valid(r.Hostname) {
		return store.Node{}, errs.Invalid("hostname", "want a host name: letters, digits and '-' in dot-separated labels")
	}
	if err := authz.ValidIdempotencyKey("idempotencyKey", r.IdempotencyKey); err != nil {
		return store.Node{}, err
	}
	var out store.Node
	create := func() error {
		return s.db.WithTx(ctx, func(tx *store.Tx) error {
			pool, err := tenancy.PoolFor(ctx, tx, p, r.TenantID, r.PoolID, authz.NodesCreate)
			if err != nil {
				return err
			}
			if err := tenancy.RunsDaemon(pool, "nodes made ahead"); err != nil {
				return err
			}
			if r.IdempotencyKey != "" {
				prev, err := tx.NodeByIdempotencyKey(ctx, r.TenantID, r.IdempotencyKey)
				if err == nil {
					// SECURITY: as for join tokens, a key used in another
					// pool names nothing of it.
					if prev.PoolID != pool.ID {
						return errs.New(errs.Conflict, "idempotency key %q is already used in this tenant for another request; choose another key", r.IdempotencyKey)
					}
					// Once bound, the machine's hostname replaced the one
					// given: only a pending node's is compared.
					if prev.State == store.NodePending && prev.Hostname != r.Hostname {
						return errs.New(errs.Conflict, "idempotency key %q was used for node %s with another hostname", r.IdempotencyKey, prev.ID)
					}
					out = prev
					return nil
				}
				if !errors.Is(err, store.ErrNotFound) {
					return err
				}
			}
			now, err := tx.Now(ctx)
			if err != nil {
				return err
			}
			n, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, now), TenantID: r.TenantID, SiteID: pool.SiteID, PoolID: pool.ID,
				Role: tokens.RoleNode, State: store.NodePending, Hostname: r.Hostname, IdempotencyKey: r.IdempotencyKey})
			if err != nil {
				return err
			}
			data := map[string]any{"nodeId": n.ID, "poolId": pool.ID, "siteId": pool.SiteID, "state": n.State, "hostname": n.Hostname, "createdBy": p.ID}
			if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: r.TenantID, Type: "node.created", Subject: n.ID, Data: data}); err != nil {
				return err
			}
			if err := events.Audit(ctx, tx, events.Entry{TenantID: r.TenantID, Actor: p.ID, Action: "node.created", Resource: Resource(n.ID), Data: data}); err != nil {
				return err
			}
			out = n
			return nil
		})
	}
	err := create()
	if store.IsUniqueViolation(err) && r.IdempotencyKey != "" {
		// A concurrent create with the same key won: answer as a replay.
		err = create()
	}
	return out, err
}
