-- +goose Up
-- The session change feed: one row per change that can end a node's
-- session (the node retired, its identity generation moved, its session
-- taken over by a newer one, a certificate of the node revoked, superseded
-- by a renewal or gone, the node gone), written by triggers in the
-- transaction that made the change. The API reads the rows after its
-- position each check (sessionchanges.go) and checks only the sessions it
-- holds of those nodes, instead of every session it holds; a slow full
-- check stays the safety net.
--
-- Triggers rather than a write in each Go path: every statement that
-- changes those columns is covered, today's and tomorrow's. SQLite's one
-- writer commits in seq order; AUTOINCREMENT keeps seq rising after the
-- oldest rows are pruned. changed_ms is compute_now() as the engine
-- writes it (wall time plus the test offset). A node disconnecting
-- (session_id back to '') ends no other session and writes no row.
CREATE TABLE session_changes (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id    TEXT NOT NULL,
    changed_ms INTEGER NOT NULL
);

-- +goose StatementBegin
CREATE TRIGGER nodes_session_changed AFTER UPDATE OF state, identity_generation, session_id ON nodes
    FOR EACH ROW WHEN NEW.state = 'retired' AND OLD.state IS NOT 'retired'
        OR NEW.identity_generation IS NOT OLD.identity_generation
        OR NEW.session_id IS NOT OLD.session_id AND NEW.session_id <> ''
BEGIN
    INSERT INTO session_changes (node_id, changed_ms)
    VALUES (OLD.id, CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1));
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER nodes_session_gone AFTER DELETE ON nodes
BEGIN
    INSERT INTO session_changes (node_id, changed_ms)
    VALUES (OLD.id, CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1));
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER node_certs_session_changed AFTER UPDATE OF revoked_ms, superseded_ms, identity_generation, serial, node_id ON node_certs
    FOR EACH ROW WHEN NEW.revoked_ms IS NOT OLD.revoked_ms OR NEW.superseded_ms IS NOT OLD.superseded_ms
        OR NEW.identity_generation IS NOT OLD.identity_generation OR NEW.serial IS NOT OLD.serial
        OR NEW.node_id IS NOT OLD.node_id
BEGIN
    INSERT INTO session_changes (node_id, changed_ms)
    VALUES (OLD.node_id, CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1));
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER node_certs_session_gone AFTER DELETE ON node_certs
BEGIN
    INSERT INTO session_changes (node_id, changed_ms)
    VALUES (OLD.node_id, CAST(unixepoch('subsec') * 1000 AS INTEGER) + (SELECT offset_ms FROM compute_clock WHERE id = 1));
END;
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER node_certs_session_gone;
DROP TRIGGER node_certs_session_changed;
DROP TRIGGER nodes_session_gone;
DROP TRIGGER nodes_session_changed;
DROP TABLE session_changes;
