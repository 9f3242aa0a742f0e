-- +goose Up
-- A token's uses, split over a few rows so that many machines joining with
-- one token at once do not queue on a single row: a join spends from any
-- slot that has uses left and no other join is spending from. The total
-- is the sum; join_tokens.uses_left is no longer updated.
CREATE TABLE join_token_slots (
    token_id  TEXT NOT NULL REFERENCES join_tokens(id),
    slot      INTEGER NOT NULL,
    uses_left INTEGER NOT NULL,
    PRIMARY KEY (token_id, slot)
);
INSERT INTO join_token_slots (token_id, slot, uses_left) SELECT id, 0, uses_left FROM join_tokens;

-- +goose Down
DROP TABLE join_token_slots;
