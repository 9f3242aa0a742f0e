-- +goose Up
-- The key of event and audit cursors (internal/events, cursor.go): ids and
-- cursors that reach a tenant are sealed positions, so they reveal nothing
-- of the one sequence every tenant's rows share (R14.3). One row, written
-- by the first replica of this version to start (store.Open, with a random
-- key: SQL cannot make one portably), read by every replica.
--
-- legacy_until_ms is when decimal cursors of earlier versions stop being
-- honoured for rows written after it: 0 for a database that had no events
-- or audit rows when the key was made, else a day after that. Expand only:
-- older replicas neither read nor write this table, so they keep working
-- during a rolling upgrade, and the down step (which makes every cursor
-- handed out since unreadable) is only for a full rollback.
CREATE TABLE stream_key (
    id              INTEGER PRIMARY KEY CHECK (id = 1),
    key             BLOB NOT NULL,
    legacy_until_ms INTEGER NOT NULL
);

-- +goose Down
DROP TABLE stream_key;
