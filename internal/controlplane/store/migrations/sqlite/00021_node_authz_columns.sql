-- +goose Up
-- The authorization projection (R1.3) moves into nodes. node_authz always
-- held the node's own tenant, site, pool and role (every join wrote it with
-- them: insert, bind, reclaim, re-join; nothing else changes those columns),
-- so what a projection row adds to the node's row is that a join wrote it,
-- and when: authz_ms, copied from node_authz.updated_ms. A node without one
-- (made ahead and not joined yet) has no projection, as before.
--
-- node_authz stays, no longer written or read, for replicas of the previous
-- release during a rolling upgrade (they still write it: expand, see
-- docs/operations/upgrade.md); the next release copies the rows they wrote and
-- drops it.
ALTER TABLE nodes ADD COLUMN authz_ms INTEGER;
UPDATE nodes SET authz_ms = (SELECT a.updated_ms FROM node_authz a WHERE a.node_id = nodes.id)
    WHERE EXISTS (SELECT 1 FROM node_authz a WHERE a.node_id = nodes.id);

-- +goose Down
-- The previous release reads node_authz: give it the projections written
-- since.
INSERT INTO node_authz (node_id, tenant_id, site_id, pool_id, role, updated_ms)
    SELECT id, tenant_id, site_id, pool_id, role, authz_ms FROM nodes WHERE authz_ms IS NOT NULL
    ON CONFLICT (node_id) DO UPDATE SET tenant_id = excluded.tenant_id, site_id = excluded.site_id, pool_id = excluded.pool_id,
        role = excluded.role, updated_ms = excluded.updated_ms;
ALTER TABLE nodes DROP COLUMN authz_ms;
