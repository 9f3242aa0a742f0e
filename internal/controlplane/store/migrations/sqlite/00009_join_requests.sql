-- +goose Up
-- Join requests (R10.1-R10.3): a join an attestor deferred to a person. One
-- open (pending or approved) request per machine, keyed by the machine's
-- key (R10.2, opaque here); a newer attempt refreshes it with its new CSR.
-- An approval admits exactly one join: consuming it moves the row to
-- consumed and names the node. Times are milliseconds since the epoch.
CREATE TABLE join_requests (
    id                TEXT PRIMARY KEY,
    tenant_id         TEXT NOT NULL REFERENCES tenants(id),
    pool_id           TEXT NOT NULL REFERENCES pools(id),
    site_id           TEXT NOT NULL,
    attestor          TEXT NOT NULL,
    role              TEXT NOT NULL,
    machine_key       TEXT NOT NULL,
    claims            TEXT NOT NULL DEFAULT '{}',
    hardware_key      BLOB,
    ek_hash           BLOB,
    mac               TEXT NOT NULL DEFAULT '',
    ip                TEXT NOT NULL DEFAULT '',
    workflow_id       TEXT NOT NULL DEFAULT '',
    vouched_by        TEXT NOT NULL DEFAULT '',
    boot_lease_epoch  INTEGER NOT NULL DEFAULT 0,
    csr_sha256        BLOB NOT NULL,
    state             TEXT NOT NULL,
    created_ms        INTEGER NOT NULL,
    updated_ms        INTEGER NOT NULL,
    decided_ms        INTEGER,
    decided_by        TEXT NOT NULL DEFAULT '',
    reason            TEXT NOT NULL DEFAULT '',
    approved_until_ms INTEGER,
    consumed_ms       INTEGER,
    node_id           TEXT NOT NULL DEFAULT ''
);
CREATE UNIQUE INDEX join_requests_open ON join_requests (tenant_id, machine_key) WHERE state IN ('pending', 'approved');
CREATE INDEX join_requests_csr ON join_requests (tenant_id, csr_sha256, id);
CREATE INDEX join_requests_pool ON join_requests (tenant_id, pool_id, state, id);

-- What each site agent booted (R10.4): the newest lease of a MAC at a site,
-- by lease epoch; an older epoch never overwrites a newer one.
CREATE TABLE site_vouches (
    tenant_id   TEXT NOT NULL,
    site_id     TEXT NOT NULL,
    mac         TEXT NOT NULL,
    ip          TEXT NOT NULL DEFAULT '',
    lease_epoch INTEGER NOT NULL,
    vouched_by  TEXT NOT NULL,
    workflow_id TEXT NOT NULL DEFAULT '',
    updated_ms  INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, site_id, mac)
);
CREATE INDEX site_vouches_mac ON site_vouches (tenant_id, mac);

-- +goose Down
DROP TABLE site_vouches;
DROP TABLE join_requests;
