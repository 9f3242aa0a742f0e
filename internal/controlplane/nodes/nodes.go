// Package nodes owns nodes through the operator API: reading a tenant's
// nodes with their lifecycle and connection state and their certificates,
// and retiring them (retire.go). Nodes are created by JoinService
// (internal/controlplane/join) and, ahead of their machines, by Create (create.go).
package nodes

import (
	"context"
	"errors"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Resource names a node for authorization.
func Resource(id string) string { return "compute-node/" + id }

// Service reads and retires nodes.
type Service struct {
	db  *store.DB
	cfg Config
}

// Config lists the Service's dependencies.
type Config struct {
	DB  *store.DB
	Hub *events.Hub
	// EndSession, when set, ends a retired node's live session on this
	// replica (the session service's EndNode).
	EndSession func(nodeID string)
}

// New returns a Service.
func New(cfg Config) *Service { return &Service{db: cfg.DB, cfg: cfg} }

// Detail is a node with its newest certificates.
type Detail struct {
	Node  store.Node
	Certs []store.NodeCert
}

// canSee reports whether p may read node n (compute:nodes:read on the node
// or its pool). A caller who cannot see a node gets NOT_FOUND for it,
// exactly as for a node that does not exist (R1.2); one who can see it but
// lacks the right for an action gets ACCESS_DENIED.
func canSee(p authz.Principal, n store.Node) bool {
	return p.Allowed(authz.NodesRead, Resource(n.ID)) || p.Allowed(authz.NodesRead, authz.PoolResource(n.PoolID))
}

// Get reads a node of the tenant. Another tenant's node, and a node the
// caller may not read, are NOT_FOUND like a missing one (R1.2).
func (s *Service) Get(ctx context.Context, p authz.Principal, tenantID, nodeID string) (Detail, error) {
	if err := p.ActFor(tenantID); err != nil {
		return Detail{}, err
	}
	var d Detail
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		n, err := tx.GetNode(ctx, nodeID)
		if errors.Is(err, store.ErrNotFound) || (err == nil && n.TenantID != tenantID) {
			return errs.New(errs.NotFound, "node %s not found", nodeID)
		}
		if err != nil {
			return err
		}
		if !canSee(p, n) {
			// R1.2: the answer a missing node gets, so a caller without
			// rights cannot tell which node ids exist.
			return errs.New(errs.NotFound, "node %s not found", nodeID)
		}
		d.Node = n
		d.Certs, err = tx.ListNodeCerts(ctx, n.ID, 20)
		return err
	})
	return d, err
}

// List lists the tenant's nodes, optionally of one pool.
func (s *Service) List(ctx context.Context, p authz.Principal, tenantID, poolID, after string, limit int) ([]store.Node, error) {
	if err := p.ActFor(tenantID); err != nil {
		return nil, err
	}
	var out []store.Node
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		res := authz.PoolResource("*")
		if poolID != "" {
			pool, err := tenancy.OwnedPool(ctx, tx, tenantID, poolID)
			if err != nil {
				return err
			}
			res = authz.PoolResource(pool.ID)
			if !p.Allowed(authz.NodesRead, res) && !p.Allowed(authz.PoolsRead, res) {
				// R1.2: a pool the caller cannot see answers as a
				// missing one does.
				return errs.New(errs.NotFound, "pool %s not found", poolID)
			}
		}
		if !p.Allowed(authz.NodesRead, res) {
			return errs.New(errs.AccessDenied, "%s is not allowed on %s", authz.NodesRead, res)
		}
		var err error
		out, err = tx.ListNodes(ctx, tenantID, poolID, after, limit)
		return err
	})
	return out, err
}
