package store

import (
	"context"
	"fmt"
)

// NodeAuthz is a node's authorization projection.
type NodeAuthz struct {
	NodeID, TenantID, SiteID, PoolID, Role string
}

// UpsertNodeAuthz writes a node's authorization projection row.
func (t *Tx) UpsertNodeAuthz(ctx context.Context, nodeID, tenantID, siteID, poolID, role string) error {
	err := t.execLater(ctx, `INSERT INTO node_authz (node_id, tenant_id, site_id, pool_id, role, updated_ms) VALUES (?, ?, ?, ?, ?, compute_now())
		ON CONFLICT (node_id) DO UPDATE SET tenant_id = excluded.tenant_id, site_id = excluded.site_id, pool_id = excluded.pool_id, role = excluded.role, updated_ms = excluded.updated_ms`,
		nodeID, tenantID, siteID, poolID, role)
	if err != nil {
		return fmt.Errorf("upsert node authz: %w", err)
	}
	return nil
}

// GetNodeAuthz reads a node's projection row.
func (t *Tx) GetNodeAuthz(ctx context.Context, nodeID string) (NodeAuthz, error) {
	var a NodeAuthz
	err := t.queryRow(ctx, "SELECT node_id, tenant_id, site_id, pool_id, role FROM node_authz WHERE node_id = ?", nodeID).Scan(&a.NodeID, &a.TenantID, &a.SiteID, &a.PoolID, &a.Role)
	return a, notFound(err)
}
