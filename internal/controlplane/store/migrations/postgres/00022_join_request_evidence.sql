-- +goose Up
-- What a join request's attestor established, apart from the machine's
-- claims (R22.1), and what approving it does (R22.2). ek_cert is the EK
-- certificate's standing ('' when the attestor is not tpm; else absent,
-- untrusted or trusted), with the certificate's subject and issuer as sent;
-- ak_name is the TPM attestation key's name. effect is new-node, reclaim or
-- bind, with effect_node_id the node taken; acknowledged_node_id is the
-- node an approval acknowledged it reclaims. Expand only: the previous
-- release inserts without these (the defaults) and never reads them.
ALTER TABLE join_requests ADD COLUMN ek_cert TEXT NOT NULL DEFAULT '';
ALTER TABLE join_requests ADD COLUMN ek_cert_subject TEXT NOT NULL DEFAULT '';
ALTER TABLE join_requests ADD COLUMN ek_cert_issuer TEXT NOT NULL DEFAULT '';
ALTER TABLE join_requests ADD COLUMN ak_name BYTEA;
ALTER TABLE join_requests ADD COLUMN effect TEXT NOT NULL DEFAULT '';
ALTER TABLE join_requests ADD COLUMN effect_node_id TEXT NOT NULL DEFAULT '';
ALTER TABLE join_requests ADD COLUMN acknowledged_node_id TEXT NOT NULL DEFAULT '';
-- Open requests of one hardware key: a second machine with the same claims
-- (another EK) is shown beside the first.
CREATE INDEX join_requests_open_hardware_key ON join_requests (tenant_id, hardware_key) WHERE state IN ('pending', 'approved');

-- +goose Down
DROP INDEX join_requests_open_hardware_key;
ALTER TABLE join_requests DROP COLUMN acknowledged_node_id;
ALTER TABLE join_requests DROP COLUMN effect_node_id;
ALTER TABLE join_requests DROP COLUMN effect;
ALTER TABLE join_requests DROP COLUMN ak_name;
ALTER TABLE join_requests DROP COLUMN ek_cert_issuer;
ALTER TABLE join_requests DROP COLUMN ek_cert_subject;
ALTER TABLE join_requests DROP COLUMN ek_cert;
