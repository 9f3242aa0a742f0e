-- +goose Up
-- Hardware keys are matched within a tenant: a machine's join is never
-- refused because of another tenant's node (claims are self-reported, so a
-- tenant that knows a machine's serials could otherwise claim it first).
-- The cross-tenant index finds collisions to report to the root tenant.
DROP INDEX nodes_hardware_key;
CREATE UNIQUE INDEX nodes_tenant_hardware_key ON nodes (tenant_id, hardware_key) WHERE hardware_key_trusted AND state <> 'retired';
CREATE INDEX nodes_hardware_key_any ON nodes (hardware_key) WHERE hardware_key_trusted AND state <> 'retired';

-- A renewal supersedes its parent: renewal and x509pop accept only a
-- node's newest certificate; a superseded one keeps authenticating a
-- session for a short overlap only.
ALTER TABLE node_certs ADD COLUMN superseded_ms BIGINT;
-- A reclaim needs a key never issued to the node.
CREATE INDEX node_certs_node_spki ON node_certs (node_id, spki_sha256);

-- +goose Down
DROP INDEX node_certs_node_spki;
ALTER TABLE node_certs DROP COLUMN superseded_ms;
DROP INDEX nodes_hardware_key_any;
DROP INDEX nodes_tenant_hardware_key;
CREATE UNIQUE INDEX nodes_hardware_key ON nodes (hardware_key) WHERE hardware_key_trusted AND state <> 'retired';
