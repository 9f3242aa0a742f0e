-- +goose Up
-- Nodes made ahead of their machines (nodes.create): state pending,
-- identity generation 0, no hardware key, until a join binds a machine to
-- them (bcd join --node-id). A creation retried with the same idempotency
-- key answers the node it made; keys are unique per tenant.
ALTER TABLE nodes ADD COLUMN idempotency_key TEXT;
CREATE UNIQUE INDEX nodes_idempotency ON nodes (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- +goose Down
DROP INDEX nodes_idempotency;
ALTER TABLE nodes DROP COLUMN idempotency_key;
