-- +goose Up
-- The SHA-256 of a tpm node's endorsement key, recorded by the join that
-- admitted it, so an approver can tell a request from a second TPM with the
-- same claims from the node it would match (R22.1). NULL for other
-- attestors and for nodes admitted before the column.
ALTER TABLE nodes ADD COLUMN ek_sha256 BLOB;

-- +goose Down
ALTER TABLE nodes DROP COLUMN ek_sha256;
