-- +goose Up
-- A vouch admits one machine (R15.3): the first node admitted on a site's
-- vouch for a MAC binds that vouch, for that lease epoch, and another node
-- presenting the same vouch is refused. The binding names the epoch it was
-- made under, so a newer lease of the NIC (UpsertSiteVouch replacing the
-- row) is unbound without the upsert touching these columns. Expand only,
-- safe while the previous release runs: nullable columns it never reads,
-- and its upserts leave them alone.
ALTER TABLE site_vouches ADD COLUMN bound_node_id TEXT;
ALTER TABLE site_vouches ADD COLUMN bound_lease_epoch INTEGER;

-- +goose Down
ALTER TABLE site_vouches DROP COLUMN bound_lease_epoch;
ALTER TABLE site_vouches DROP COLUMN bound_node_id;
