-- +goose Up
-- Renewal proofs seen recently (R13.2): a proof is refused when its hash is
-- here and not yet expired. Rows expire 120 s after first use and are
-- pruned by later renewals.
CREATE TABLE renew_proofs (
    proof_sha256 BYTEA PRIMARY KEY,
    node_id      TEXT NOT NULL,
    expires_ms   BIGINT NOT NULL
);
CREATE INDEX renew_proofs_expiry ON renew_proofs (expires_ms);

-- +goose Down
DROP TABLE renew_proofs;
