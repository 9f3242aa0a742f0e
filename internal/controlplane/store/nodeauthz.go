package store

import (
	"context"
)

// NodeAuthz is a node's authorization projection (R1.3): which tenant, site
// and pool it belongs to, in which role. It is the node row's own columns
// once a join wrote it (nodes.authz_ms: InsertNode with Node.Authz,
// BindPendingNode, ReclaimNode), so it costs a join no statement of its
// own; a node made ahead and not joined yet has none.
type NodeAuthz struct {
	NodeID, TenantID, SiteID, PoolID, Role string
}

// GetNodeAuthz reads a node's projection; ErrNotFound when it has none.
// During a rolling upgrade a replica of the previous release writes
// node_authz instead of authz_ms (migration 00021), and its rows count too.
func (t *Tx) GetNodeAuthz(ctx context.Context, nodeID string) (NodeAuthz, error) {
	var a NodeAuthz
	err := t.queryRow(ctx, `SELECT id, tenant_id, site_id, pool_id, role FROM nodes n
		WHERE id = ? AND (authz_ms IS NOT NULL OR EXISTS (SELECT 1 FROM node_authz a WHERE a.node_id = n.id))`, nodeID).Scan(&a.NodeID, &a.TenantID, &a.SiteID, &a.PoolID, &a.Role)
	return a, notFound(err)
}
