-- +goose Up
-- Work queue leases that move within seconds. Each controller
-- registers as an owner whose lease it renews every poll; a claimed item
-- names its owner, and another replica takes it over as soon as that
-- owner's lease expired (a dead replica), not when the item's own claim
-- ran out. Expand only: an older replica that knows nothing of owners
-- still claims by not_before_ms, which claims keep setting.
CREATE TABLE work_owners (
    owner_id   TEXT PRIMARY KEY,
    expires_ms INTEGER NOT NULL
);
ALTER TABLE work_queue ADD COLUMN owner TEXT;
CREATE INDEX work_queue_owned ON work_queue (owner) WHERE owner IS NOT NULL;

-- +goose Down
DROP INDEX work_queue_owned;
ALTER TABLE work_queue DROP COLUMN owner;
DROP TABLE work_owners;
