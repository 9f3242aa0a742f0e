-- +goose Up
-- The session change feed: one row per change that can end a node's
-- session (the node retired, its identity generation moved, its session
-- taken over by a newer one, a certificate of the node revoked, superseded
-- by a renewal or gone, the node gone), written by triggers in the
-- transaction that made the change. Every API replica reads the rows after
-- its position each check (sessionchanges.go) and checks only the sessions
-- it holds of those nodes, instead of every session it holds; a slow full
-- check stays the safety net.
--
-- Triggers rather than a write in each Go path: every statement that
-- changes those columns is covered, today's and tomorrow's, and so are the
-- writes of a previous release's replica during a rolling upgrade (it
-- knows nothing of the feed). seq comes from a sequence, so a transaction
-- can commit after one with a higher seq was read: readers remember the
-- holes they passed and read them again for a while (SessionFeed).
--
-- Rows are pruned some minutes after they were written (every reader has
-- long read them); a node disconnecting (session_id back to '') ends no
-- other replica's session and writes none.
CREATE TABLE session_changes (
    seq        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    node_id    TEXT NOT NULL,
    changed_ms BIGINT NOT NULL
);

-- +goose StatementBegin
CREATE FUNCTION session_changed_node() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO session_changes (node_id, changed_ms) VALUES (OLD.id, compute_now());
    RETURN NULL;
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE FUNCTION session_changed_cert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO session_changes (node_id, changed_ms) VALUES (OLD.node_id, compute_now());
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER nodes_session_changed AFTER UPDATE OF state, identity_generation, session_id ON nodes
    FOR EACH ROW WHEN (NEW.state = 'retired' AND OLD.state IS DISTINCT FROM 'retired'
        OR NEW.identity_generation IS DISTINCT FROM OLD.identity_generation
        OR NEW.session_id IS DISTINCT FROM OLD.session_id AND NEW.session_id <> '')
    EXECUTE FUNCTION session_changed_node();
CREATE TRIGGER nodes_session_gone AFTER DELETE ON nodes
    FOR EACH ROW EXECUTE FUNCTION session_changed_node();
CREATE TRIGGER node_certs_session_changed AFTER UPDATE OF revoked_ms, superseded_ms, identity_generation, serial, node_id ON node_certs
    FOR EACH ROW WHEN (NEW.revoked_ms IS DISTINCT FROM OLD.revoked_ms OR NEW.superseded_ms IS DISTINCT FROM OLD.superseded_ms
        OR NEW.identity_generation IS DISTINCT FROM OLD.identity_generation OR NEW.serial IS DISTINCT FROM OLD.serial
        OR NEW.node_id IS DISTINCT FROM OLD.node_id)
    EXECUTE FUNCTION session_changed_cert();
CREATE TRIGGER node_certs_session_gone AFTER DELETE ON node_certs
    FOR EACH ROW EXECUTE FUNCTION session_changed_cert();

-- +goose Down
DROP TRIGGER node_certs_session_gone ON node_certs;
DROP TRIGGER node_certs_session_changed ON node_certs;
DROP TRIGGER nodes_session_gone ON nodes;
DROP TRIGGER nodes_session_changed ON nodes;
DROP FUNCTION session_changed_cert();
DROP FUNCTION session_changed_node();
DROP TABLE session_changes;
