-- +goose Up
-- Exporting events and audit rows to external sinks (exportpos.go).
--
-- Events are read for export across tenants in stream order (tx_order, id),
-- which the sequencer makes gapless; events_export serves that read.
--
-- Audit ids come from a sequence and can commit out of order, so the
-- exporter reads audit rows in (writer_xid, id) order and only those
-- written by transactions older than every one still running
-- (pg_snapshot_xmin): such a row is committed or gone for good, and no
-- later row can appear before the exporter's position. writer_xid is the
-- writing transaction's id, as events' (00008). Rows written before this
-- migration keep NULL and are read as 0, first: all committed before it
-- (the ALTER waits for every transaction writing audit). Adding the column
-- without a default and then setting one leaves the table unrewritten, so
-- a rolling upgrade does not stop the old replicas' writes for a rewrite.
ALTER TABLE audit ADD COLUMN writer_xid BIGINT;
ALTER TABLE audit ALTER COLUMN writer_xid SET DEFAULT (pg_current_xact_id()::TEXT::BIGINT);
CREATE INDEX audit_export ON audit ((COALESCE(writer_xid, 0)), id);
CREATE INDEX events_export ON events (tx_order, id) WHERE tx_order IS NOT NULL;

-- One row per lease: the replica exporting holds "export" until
-- expires_ms (compute_now()), renewing it; another takes it over once it
-- expired.
CREATE TABLE export_leases (
    name       TEXT PRIMARY KEY,
    holder     TEXT NOT NULL,
    expires_ms BIGINT NOT NULL
);

-- What each sink acknowledged: the position after the last event and
-- audit row it took. Written only after the sink acknowledged, and only by
-- the lease's holder.
CREATE TABLE export_positions (
    sink        TEXT PRIMARY KEY,
    event_order BIGINT NOT NULL DEFAULT 0,
    event_id    BIGINT NOT NULL DEFAULT 0,
    audit_order BIGINT NOT NULL DEFAULT 0,
    audit_id    BIGINT NOT NULL DEFAULT 0,
    updated_ms  BIGINT NOT NULL
);

-- +goose Down
DROP TABLE export_positions;
DROP TABLE export_leases;
DROP INDEX events_export;
DROP INDEX audit_export;
ALTER TABLE audit DROP COLUMN writer_xid;
