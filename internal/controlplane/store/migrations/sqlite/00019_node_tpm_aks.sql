-- +goose Up
-- Which node a TPM's attestation key belongs to, in each tenant (R9.2,
-- R15.3): a tpm join proves the same EK and AK as an existing node, and
-- under its pool's allow_reclaim takes that node back (same id, the next
-- identity generation) instead of making another. Written by each tpm join
-- in its transaction; filled here from the certificates of nodes that
-- joined before it. ak_statement is the certificate's urn:bc:tpm-ak:… .
CREATE TABLE node_tpm_aks (
    tenant_id    TEXT NOT NULL,
    ak_statement TEXT NOT NULL,
    node_id      TEXT NOT NULL REFERENCES nodes(id),
    PRIMARY KEY (tenant_id, ak_statement)
);
INSERT INTO node_tpm_aks (tenant_id, ak_statement, node_id)
SELECT n.tenant_id, je.value, n.id
FROM nodes n
JOIN node_certs c ON c.node_id = n.id AND c.identity_generation = n.identity_generation, json_each(c.statements) je
WHERE n.state <> 'retired' AND je.value LIKE 'urn:bc:tpm-ak:%'
ON CONFLICT (tenant_id, ak_statement) DO NOTHING;

-- +goose Down
DROP TABLE node_tpm_aks;
