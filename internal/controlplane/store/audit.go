package store

import (
	"context"
	"fmt"
	"time"
)

// AuditEntry is an audit row. Data is JSON.
type AuditEntry struct {
	ID        int64
	TenantID  string
	Actor     string
	Action    string
	Resource  string
	Data      []byte
	CreatedAt time.Time
}

var auditInsert = newMultiInsert("INSERT INTO audit (tenant_id, actor, action, resource, data, created_ms) VALUES", "(?, ?, ?, ?, ?, compute_now())")

// InsertAudit writes an audit row in the current transaction.
func (t *Tx) InsertAudit(ctx context.Context, a AuditEntry) error {
	return t.InsertAudits(ctx, a)
}

// InsertAudits writes audit rows in the current transaction, in the order
// given (their ids ascend in it), in one statement per maxInsertRows of
// them. Only the rows' tenant, actor, action, resource and data are used.
func (t *Tx) InsertAudits(ctx context.Context, rows ...AuditEntry) error {
	err := t.insertRows(ctx, auditInsert, len(rows), 5, func(args []any, i int) []any {
		a := rows[i]
		return append(args, a.TenantID, a.Actor, a.Action, a.Resource, string(a.Data))
	})
	if err != nil {
		return fmt.Errorf("insert audit: %w", err)
	}
	return nil
}

// ListAudit reads a tenant's audit rows, newest first, with ids below
// `before` (0: from the newest).
func (t *Tx) ListAudit(ctx context.Context, tenantID string, before int64, limit int) ([]AuditEntry, error) {
	rows, err := t.query(ctx, `SELECT `+auditCols+` FROM audit
		WHERE tenant_id = ? AND (? = 0 OR id < ?) ORDER BY id DESC LIMIT ?`, tenantID, before, before, limit)
	if err != nil {
		return nil, fmt.Errorf("list audit: %w", err)
	}
	return scanAudit(rows)
}

// auditCols are the columns scanAudit reads, in its order.
const auditCols = "id, tenant_id, actor, action, resource, data, created_ms"

// scanAudit reads every audit row of rows and closes them.
func scanAudit(rows Rows) ([]AuditEntry, error) {
	defer rows.Close()
	var out []AuditEntry
	for rows.Next() {
		var a AuditEntry
		var data string
		var created int64
		if err := rows.Scan(&a.ID, &a.TenantID, &a.Actor, &a.Action, &a.Resource, &data, &created); err != nil {
			return nil, err
		}
		a.Data, a.CreatedAt = []byte(data), fromMS(created)
		out = append(out, a)
	}
	return out, rows.Err()
}

// ListAuditAfter reads a tenant's audit rows with ids above after (0: from
// the oldest), oldest first: the order events are read in, so one cursor
// loop reads both.
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
