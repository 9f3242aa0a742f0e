-- +goose Up
-- The pins a node's daemon said it holds at its last session's Hello
-- (R21.2), one per line, signed by its node key: pki status counts a node
-- as behind a rotation until they include the keys in force. Empty: never
-- said (a daemon before the field, or no session since).
ALTER TABLE nodes ADD COLUMN pins_ack TEXT NOT NULL DEFAULT '';

-- +goose Down
ALTER TABLE nodes DROP COLUMN pins_ack;
