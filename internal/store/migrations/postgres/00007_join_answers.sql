-- +goose Up
-- The answer given to each join request, by request digest (R4.9): the same
-- request arriving again gets it back and spends nothing.
CREATE TABLE join_answers (
    request_digest BYTEA PRIMARY KEY,
    node_id        TEXT NOT NULL,
    response       BYTEA NOT NULL,
    created_ms     BIGINT NOT NULL,
    expires_ms     BIGINT NOT NULL
);
CREATE INDEX join_answers_expiry ON join_answers (expires_ms);

-- +goose Down
DROP TABLE join_answers;
