package store

import (
	"context"
	"fmt"
)

// FailPendingCommands fails a node's queued and sent commands with errText
// and returns their ids.
func (t *Tx) FailPendingCommands(ctx context.Context, nodeID, errText string) ([]string, error) {
	rows, err := t.query(ctx, "SELECT id FROM commands WHERE node_id = ? AND state IN ('queued', 'sent') ORDER BY id", nodeID)
	if err != nil {
		return nil, fmt.Errorf("find pending commands: %w", err)
	}
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		ids = append(ids, id)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(ids) == 0 {
		return nil, nil
	}
	if _, err := t.exec(ctx, "UPDATE commands SET state = 'failed', error = ?, finished_ms = compute_now() WHERE node_id = ? AND state IN ('queued', 'sent')", errText, nodeID); err != nil {
		return nil, fmt.Errorf("fail pending commands: %w", err)
	}
	return ids, nil
}
