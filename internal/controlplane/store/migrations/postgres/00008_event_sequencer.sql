-- +goose Up
-- Events get their stream position after they commit, from the sequencer
-- (internal/store/sequencer.go), instead of being hidden while any older
-- transaction of the cluster runs (pg_snapshot_xmin), which let one long
-- transaction in any database stall every tenant's stream.
--
-- tx_order is NULL until a sequencer pass numbers the event, one number per
-- writing transaction; readers never see NULL rows. writer_xid groups a
-- transaction's events and orders transactions within a pass. Numbers
-- continue above every transaction id used so far, so cursors handed out
-- before this migration stay valid.
ALTER TABLE events ALTER COLUMN tx_order DROP DEFAULT;
ALTER TABLE events ALTER COLUMN tx_order DROP NOT NULL;
ALTER TABLE events ADD COLUMN writer_xid BIGINT NOT NULL DEFAULT (pg_current_xact_id()::TEXT::BIGINT);
CREATE INDEX events_unsequenced ON events (writer_xid) WHERE tx_order IS NULL;

-- The one row whose lock serializes sequencer passes; last is the highest
-- tx_order given.
CREATE TABLE event_sequencer (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    last BIGINT NOT NULL
);
INSERT INTO event_sequencer (id, last) SELECT 1, COALESCE(MAX(tx_order), 0) FROM events;

-- +goose Down
UPDATE events SET tx_order = writer_xid WHERE tx_order IS NULL;
DROP TABLE event_sequencer;
DROP INDEX events_unsequenced;
ALTER TABLE events DROP COLUMN writer_xid;
ALTER TABLE events ALTER COLUMN tx_order SET DEFAULT (pg_current_xact_id()::TEXT::BIGINT);
ALTER TABLE events ALTER COLUMN tx_order SET NOT NULL;
