-- +goose Up
-- Hardware keys are matched within a tenant: a machine's join is never
-- refused because of another tenant's node (claims are self-reported, so a
-- tenant that knows a machine's serials could otherwise claim it first).
-- One live node per trusted key per tenant; the key leads the index, so a
-- join finds its tenant's node and other tenants' collisions (reported to
-- the root tenant) with one lookup.
DROP INDEX nodes_hardware_key;
CREATE UNIQUE INDEX nodes_hardware_key_tenant ON nodes (hardware_key, tenant_id) WHERE hardware_key_trusted = 1 AND state <> 'retired';

-- A renewal supersedes its parent: renewal and x509pop accept only a
-- node's newest certificate; a superseded one keeps authenticating a
-- session for a short overlap only. (A reclaim's check that its key was
-- never issued to the node reads the node's rows through node_certs_node.)
ALTER TABLE node_certs ADD COLUMN superseded_ms INTEGER;

-- +goose Down
ALTER TABLE node_certs DROP COLUMN superseded_ms;
DROP INDEX nodes_hardware_key_tenant;
CREATE UNIQUE INDEX nodes_hardware_key ON nodes (hardware_key) WHERE hardware_key_trusted = 1 AND state <> 'retired';
