-- +goose Up
-- Rate limits shared by every API replica (events.Limiter): one row per
-- limited key (tenant, kind, attestor, reason) counting the events of its
-- current window, the ones dropped since the last admitted one, and the
-- count the last admitted event carried. One atomic upsert per event
-- (Tx.CountLimited), so N replicas admit what one would.
CREATE TABLE event_limits (
    limit_key       TEXT PRIMARY KEY,
    window_start_ms BIGINT NOT NULL,
    n               BIGINT NOT NULL,
    suppressed      BIGINT NOT NULL,
    carried         BIGINT NOT NULL
);

-- +goose Down
DROP TABLE event_limits;
