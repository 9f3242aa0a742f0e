-- +goose Up
-- The row /readyz writes (store.CheckWrites, R19.1): a database can answer
-- reads while it refuses every write (read-only, a standby, out of space),
-- and readiness must fail then. One row, rewritten at most once a second
-- per replica. Expand only: older replicas never touch it.
CREATE TABLE ready_probe (
    id    SMALLINT PRIMARY KEY CHECK (id = 1),
    at_ms BIGINT NOT NULL
);

-- +goose Down
DROP TABLE ready_probe;
