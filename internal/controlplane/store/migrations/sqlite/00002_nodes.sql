-- +goose Up
CREATE TABLE nodes (
    id                   TEXT PRIMARY KEY,
    tenant_id            TEXT NOT NULL REFERENCES tenants(id),
    site_id              TEXT NOT NULL REFERENCES sites(id),
    pool_id              TEXT NOT NULL REFERENCES pools(id),
    role                 TEXT NOT NULL,
    state                TEXT NOT NULL,
    state_reason         TEXT NOT NULL DEFAULT '',
    connection           TEXT NOT NULL DEFAULT 'disconnected',
    last_seen_ms         INTEGER,
    identity_generation  INTEGER NOT NULL,
    hardware_key         BLOB,
    hardware_key_trusted INTEGER NOT NULL DEFAULT 0,
    node_key             TEXT NOT NULL,
    attestor             TEXT NOT NULL,
    hostname             TEXT NOT NULL DEFAULT '',
    claims               TEXT NOT NULL DEFAULT '{}',
    join_token_id        TEXT NOT NULL DEFAULT '',
    created_ms           INTEGER NOT NULL,
    updated_ms           INTEGER NOT NULL
);
-- One live node per trusted hardware key: the reclaim lookup, and what makes
-- two racing joins of one machine end with one node.
CREATE UNIQUE INDEX nodes_hardware_key ON nodes (hardware_key) WHERE hardware_key_trusted = 1 AND state <> 'retired';
CREATE INDEX nodes_tenant ON nodes (tenant_id, id);
CREATE INDEX nodes_pool ON nodes (pool_id, id);

CREATE TABLE node_certs (
    serial              TEXT PRIMARY KEY,
    node_id             TEXT NOT NULL REFERENCES nodes(id),
    identity_generation INTEGER NOT NULL,
    role                TEXT NOT NULL,
    spki_sha256         BLOB NOT NULL,
    der                 BLOB NOT NULL,
    allowed_kinds       TEXT NOT NULL DEFAULT '[]',
    statements          TEXT NOT NULL DEFAULT '[]',
    not_before_ms       INTEGER NOT NULL,
    not_after_ms        INTEGER NOT NULL,
    created_ms          INTEGER NOT NULL,
    revoked_ms          INTEGER,
    revoke_reason       TEXT NOT NULL DEFAULT ''
);
CREATE INDEX node_certs_node ON node_certs (node_id, identity_generation);

-- The authorization projection: which tenant, site and pool a node belongs
-- to, written in the join transaction.
CREATE TABLE node_authz (
    node_id    TEXT PRIMARY KEY REFERENCES nodes(id),
    tenant_id  TEXT NOT NULL,
    site_id    TEXT NOT NULL,
    pool_id    TEXT NOT NULL,
    role       TEXT NOT NULL,
    updated_ms INTEGER NOT NULL
);

-- The controllers' durable work queue.
CREATE TABLE work_queue (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    kind         TEXT NOT NULL,
    node_id      TEXT NOT NULL,
    not_before_ms INTEGER NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    last_error   TEXT NOT NULL DEFAULT '',
    created_ms   INTEGER NOT NULL
);
CREATE INDEX work_queue_due ON work_queue (not_before_ms, id);

-- +goose Down
DROP TABLE work_queue;
DROP TABLE node_authz;
DROP TABLE node_certs;
DROP TABLE nodes;
