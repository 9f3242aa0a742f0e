package store

import (
	"context"
	"fmt"
)

// ListAuditAfter reads a tenant's audit rows with ids above after (0: from
// the oldest), oldest first: the order events are read in, so one cursor
// loop reads both (issue 8 point 8).
//
// On SQLite the one writer makes id order commit order. On PostgreSQL ids
// come from a sequence and can commit out of order, so a reader that pages
// past a row while an older transaction still holds a lower id does not see
// that row later; events guard against this (ListEvents), audit rows do not
// yet.
func (t *Tx) ListAuditAfter(ctx context.Context, tenantID string, after int64, limit int) ([]AuditEntry, error) {
	rows, err := t.query(ctx, `SELECT `+auditCols+` FROM audit
		WHERE tenant_id = ? AND id > ? ORDER BY id LIMIT ?`, tenantID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list audit: %w", err)
	}
	return scanAudit(rows)
}
