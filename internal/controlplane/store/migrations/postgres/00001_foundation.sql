-- +goose Up
-- Times are integer milliseconds since the Unix epoch, read from compute_now().
CREATE TABLE compute_clock (
    id        INTEGER PRIMARY KEY CHECK (id = 1),
    offset_ms BIGINT NOT NULL DEFAULT 0
);
INSERT INTO compute_clock (id, offset_ms) VALUES (1, 0);

-- compute_now() is the clock that decides expiry: wall time of the database
-- plus an offset that tests move. Milliseconds since the Unix epoch.
-- +goose StatementBegin
CREATE FUNCTION compute_now() RETURNS BIGINT LANGUAGE SQL STABLE AS $$
    SELECT (extract(epoch FROM statement_timestamp()) * 1000)::BIGINT
         + (SELECT offset_ms FROM compute_clock WHERE id = 1)
$$;
-- +goose StatementEnd

CREATE TABLE deployment (
    id             INTEGER PRIMARY KEY CHECK (id = 1),
    root_tenant_id TEXT
);
INSERT INTO deployment (id) VALUES (1);

CREATE TABLE tenants (
    id         TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    created_ms BIGINT NOT NULL
);

CREATE TABLE sites (
    id              TEXT PRIMARY KEY,
    owner_tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name            TEXT NOT NULL,
    region          TEXT NOT NULL DEFAULT '',
    custom          BOOLEAN NOT NULL DEFAULT FALSE,
    created_ms      BIGINT NOT NULL,
    UNIQUE (owner_tenant_id, name)
);

CREATE TABLE pools (
    id              TEXT PRIMARY KEY,
    site_id         TEXT NOT NULL REFERENCES sites(id),
    owner_tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name            TEXT NOT NULL,
    agent           TEXT NOT NULL,
    policy          TEXT NOT NULL DEFAULT '{}',
    created_ms      BIGINT NOT NULL,
    updated_ms      BIGINT NOT NULL,
    UNIQUE (site_id, name)
);
CREATE INDEX pools_owner ON pools (owner_tenant_id, id);

CREATE TABLE principals (
    id         TEXT PRIMARY KEY,
    tenant_id  TEXT NOT NULL REFERENCES tenants(id),
    name       TEXT NOT NULL,
    grants     TEXT NOT NULL DEFAULT '[]',
    created_ms BIGINT NOT NULL,
    UNIQUE (tenant_id, name)
);

CREATE TABLE api_keys (
    id            TEXT PRIMARY KEY,
    principal_id  TEXT NOT NULL REFERENCES principals(id),
    tenant_id     TEXT NOT NULL REFERENCES tenants(id),
    secret_sha256 BYTEA NOT NULL,
    created_ms    BIGINT NOT NULL,
    expires_ms    BIGINT,
    revoked_ms    BIGINT
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id, id);

CREATE TABLE join_tokens (
    id              TEXT PRIMARY KEY,
    tenant_id       TEXT NOT NULL REFERENCES tenants(id),
    pool_id         TEXT NOT NULL REFERENCES pools(id),
    site_id         TEXT NOT NULL REFERENCES sites(id),
    role            TEXT NOT NULL,
    secret_sha256   BYTEA NOT NULL,
    max_uses        BIGINT NOT NULL,
    uses_left       BIGINT NOT NULL,
    expect          TEXT NOT NULL DEFAULT '{}',
    allow_reclaim   BOOLEAN NOT NULL DEFAULT FALSE,
    hosted          TEXT NOT NULL DEFAULT '',
    idempotency_key TEXT,
    created_by      TEXT NOT NULL,
    created_ms      BIGINT NOT NULL,
    expires_ms      BIGINT NOT NULL,
    revoked_ms      BIGINT,
    UNIQUE (tenant_id, idempotency_key)
);
CREATE INDEX join_tokens_pool ON join_tokens (pool_id, id);

-- tx_order is the writing transaction's id: readers only return events of
-- transactions older than every one still running, ordered by (tx_order, id),
-- so a cursor never skips an event that commits late.
CREATE TABLE events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tx_order   BIGINT NOT NULL DEFAULT (pg_current_xact_id()::TEXT::BIGINT),
    tenant_id  TEXT NOT NULL,
    type       TEXT NOT NULL,
    subject    TEXT NOT NULL DEFAULT '',
    data       TEXT NOT NULL DEFAULT '{}',
    created_ms BIGINT NOT NULL
);
CREATE INDEX events_tenant ON events (tenant_id, tx_order, id);

CREATE TABLE audit (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id  TEXT NOT NULL,
    actor      TEXT NOT NULL,
    action     TEXT NOT NULL,
    resource   TEXT NOT NULL,
    data       TEXT NOT NULL DEFAULT '{}',
    created_ms BIGINT NOT NULL
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
DROP FUNCTION compute_now();
DROP TABLE compute_clock;
