-- +goose Up
-- R12.1: the session that last marked a node connected. Only that session
-- may mark it disconnected, so a stale stream ending on one replica does not
-- undo a newer session on another.
ALTER TABLE nodes ADD COLUMN session_id TEXT NOT NULL DEFAULT '';

-- R12.2/R12.3: commands to nodes. A controller writes a row (queued); the
-- session layer signs and delivers it to the node's live session (sent);
-- the node's CommandResult finishes it (done when ok, failed otherwise), or
-- it expires undelivered or unanswered (expired).
CREATE TABLE commands (
    id                  TEXT PRIMARY KEY,
    node_id             TEXT NOT NULL REFERENCES nodes(id),
    identity_generation INTEGER NOT NULL,
    kind                TEXT NOT NULL,
    args                TEXT NOT NULL DEFAULT '{}',
    state               TEXT NOT NULL,
    result              TEXT NOT NULL DEFAULT '',
    error               TEXT NOT NULL DEFAULT '',
    created_ms          INTEGER NOT NULL,
    expires_ms          INTEGER NOT NULL,
    sent_ms             INTEGER,
    finished_ms         INTEGER
);
CREATE INDEX commands_node ON commands (node_id, created_ms);
CREATE INDEX commands_queued ON commands (state, node_id);

-- +goose Down
DROP TABLE commands;
ALTER TABLE nodes DROP COLUMN session_id;
