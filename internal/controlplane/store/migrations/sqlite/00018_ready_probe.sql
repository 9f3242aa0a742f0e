-- +goose Up
-- The row /readyz writes (store.CheckWrites, R19.1): a database can answer
-- reads while it refuses every write (read-only, out of space), and
-- readiness must fail then. One row, rewritten at most once a second per
-- replica. Expand only: older replicas never touch it.
CREATE TABLE ready_probe (
    id    INTEGER PRIMARY KEY CHECK (id = 1),
    at_ms INTEGER NOT NULL
);

-- +goose Down
DROP TABLE ready_probe;
