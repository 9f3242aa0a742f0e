-- +goose Up
-- Times are integer milliseconds since the Unix epoch, read from compute_now().
CREATE TABLE compute_clock (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    offset_ms INTEGER NOT NULL DEFAULT 0
);
INSERT INTO compute_clock (id, offset_ms) VALUES (1, 0);

CREATE TABLE deployment (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    root_tenant_id TEXT
);
INSERT INTO deployment (id) VALUES (1);

CREATE TABLE tenants (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    created_ms INTEGER NOT NULL
);

CREATE TABLE sites (
    id              TEXT PRIMARY KEY,
    owner_tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name            TEXT NOT NULL,
    region          TEXT NOT NULL DEFAULT '',
    custom          INTEGER NOT NULL DEFAULT 0,
    created_ms      INTEGER NOT NULL,
    UNIQUE (owner_tenant_id, name)
);

CREATE TABLE pools (
    id              TEXT PRIMARY KEY,
    site_id         TEXT NOT NULL REFERENCES sites(id),
    owner_tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name            TEXT NOT NULL,
    agent           TEXT NOT NULL,
    policy          TEXT NOT NULL DEFAULT '{}',
    created_ms      INTEGER NOT NULL,
    updated_ms      INTEGER NOT NULL,
    UNIQUE (site_id, name)
);
CREATE INDEX pools_owner ON pools (owner_tenant_id, id);

CREATE TABLE principals (
    id         TEXT PRIMARY KEY,
    tenant_id  TEXT NOT NULL REFERENCES tenants(id),
    name       TEXT NOT NULL,
    grants     TEXT NOT NULL DEFAULT '[]',
    created_ms INTEGER NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,
    principal_id  TEXT NOT NULL REFERENCES principals(id),
    tenant_id     TEXT NOT NULL REFERENCES tenants(id),
    secret_sha256 BLOB NOT NULL,
    created_ms    INTEGER NOT NULL,
    expires_ms    INTEGER,
    revoked_ms    INTEGER
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, id);

CREATE TABLE join_tokens (
    id              TEXT PRIMARY KEY,
    tenant_id       TEXT NOT NULL REFERENCES tenants(id),
    pool_id         TEXT NOT NULL REFERENCES pools(id),
    site_id         TEXT NOT NULL REFERENCES sites(id),
    role            TEXT NOT NULL,
    secret_sha256   BLOB NOT NULL,
    max_uses        INTEGER NOT NULL,
    uses_left       INTEGER NOT NULL,
    expect          TEXT NOT NULL DEFAULT '{}',
    allow_reclaim   INTEGER NOT NULL DEFAULT 0,
    hosted          TEXT NOT NULL DEFAULT '',
    idempotency_key TEXT,
    created_by      TEXT NOT NULL,
    created_ms      INTEGER NOT NULL,
    expires_ms      INTEGER NOT NULL,
    revoked_ms      INTEGER,
    UNIQUE (tenant_id, idempotency_key)
);
CREATE INDEX join_tokens_pool ON join_tokens (pool_id, id);

-- tx_order orders events by commit in PostgreSQL; SQLite has one writer, so
-- the id alone is commit order there and tx_order stays 0.
CREATE TABLE events (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    tx_order   INTEGER NOT NULL DEFAULT 0,
    tenant_id  TEXT NOT NULL,
    type       TEXT NOT NULL,
    subject    TEXT NOT NULL DEFAULT '',
    data       TEXT NOT NULL DEFAULT '{}',
    created_ms INTEGER NOT NULL
);
CREATE INDEX events_tenant ON events (tenant_id, tx_order, id);

CREATE TABLE audit (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id  TEXT NOT NULL,
    actor      TEXT NOT NULL,
    action     TEXT NOT NULL,
    resource   TEXT NOT NULL,
    data       TEXT NOT NULL DEFAULT '{}',
    created_ms INTEGER NOT NULL
);
CREATE INDEX audit_tenant ON audit (tenant_id, id);

-- +goose Down
DROP TABLE audit;
DROP TABLE events;
DROP TABLE join_tokens;
DROP TABLE api_keys;
DROP TABLE principals;
DROP TABLE pools;
DROP TABLE sites;
DROP TABLE tenants;
DROP TABLE deployment;
DROP TABLE compute_clock;
