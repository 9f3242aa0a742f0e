-- +goose Up
-- The answer JoinService gave each join request, by the request's digest
-- (pki.JoinRequestDigest), so that the same request arriving again gets the
-- same answer and spends nothing (R4.9): a daemon that lost the answer to a
-- landed join recovers it by retrying, and a replay gains nothing. A row
-- counts until expires_ms, compared with compute_now(); expired rows are
-- deleted in batches.
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
