package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// SetNodeTPMAK records that the TPM attestation key statement ak (the
// certificate's urn:bc:tpm-ak:…) is node nodeID's in tenantID, replacing
// whichever node had it, and that the node's endorsement key hashes to
// ekHash (shown to approvers beside join requests, R22.1).
func (t *Tx) SetNodeTPMAK(ctx context.Context, tenantID, ak, nodeID string, ekHash []byte) error {
	_, err := t.exec(ctx, `INSERT INTO node_tpm_aks (tenant_id, ak_statement, node_id) VALUES (?, ?, ?)
		ON CONFLICT (tenant_id, ak_statement) DO UPDATE SET node_id = excluded.node_id`, tenantID, ak, nodeID)
	if err != nil {
		return fmt.Errorf("record the node's TPM: %w", err)
	}
	if _, err := t.exec(ctx, "UPDATE nodes SET ek_sha256 = ? WHERE id = ?", nullBytes(ekHash), nodeID); err != nil {
		return fmt.Errorf("record the node's EK: %w", err)
	}
	return nil
}

// NodeByTPMAK returns the node whose TPM has attestation key statement ak
// in tenantID; ErrNotFound when none has.
func (t *Tx) NodeByTPMAK(ctx context.Context, tenantID, ak string) (Node, error) {
	var id string
	err := t.queryRow(ctx, "SELECT node_id FROM node_tpm_aks WHERE tenant_id = ? AND ak_statement = ?", tenantID, ak).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return Node{}, ErrNotFound
	}
	if err != nil {
		return Node{}, fmt.Errorf("read the node of a TPM: %w", err)
	}
	return t.GetNode(ctx, id)
}
