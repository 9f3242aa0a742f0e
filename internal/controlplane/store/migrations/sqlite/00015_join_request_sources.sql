-- +goose Up
-- Where a deferred join came from (R15.4): the peer address the gateway
-- saw, so JoinService can bound the pending join requests one source can
-- make, as it bounds those of a pool. Expand only: the previous release
-- inserts without it (the default) and never reads it.
ALTER TABLE join_requests ADD COLUMN source TEXT NOT NULL DEFAULT '';
CREATE INDEX join_requests_pending_source ON join_requests (source) WHERE state = 'pending';

-- +goose Down
DROP INDEX join_requests_pending_source;
ALTER TABLE join_requests DROP COLUMN source;
