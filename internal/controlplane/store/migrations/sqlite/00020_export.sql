-- +goose Up
-- Exporting events and audit rows to external sinks (exportpos.go).
--
-- SQLite's one writer commits in id order, so events are exported in
-- (tx_order, id) order (tx_order stays 0) and audit rows in id order.
CREATE INDEX events_export ON events (tx_order, id);

-- One row per lease: the process exporting holds "export" until
-- expires_ms (compute_now()), renewing it; another takes it over once it
-- expired.
CREATE TABLE export_leases (
    name       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    expires_ms INTEGER NOT NULL
);

-- What each sink acknowledged: the position after the last event and
-- audit row it took. Written only after the sink acknowledged, and only by
-- the lease's holder.
CREATE TABLE export_positions (
    sink        TEXT PRIMARY KEY,
    event_order INTEGER NOT NULL DEFAULT 0,
    event_id    INTEGER NOT NULL DEFAULT 0,
    audit_order INTEGER NOT NULL DEFAULT 0,
    audit_id    INTEGER NOT NULL DEFAULT 0,
    updated_ms  INTEGER NOT NULL
);

-- +goose Down
DROP TABLE export_positions;
DROP TABLE export_leases;
DROP INDEX events_export;
