package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Event is an events row. Data is JSON.
type Event struct {
	ID        int64
	TxOrder   int64
	TenantID  string
	Type      string
	Subject   string
	Data      []byte
	CreatedAt time.Time
}

// Cursor returns the position just after e, for the next read.
func (e Event) Cursor() string { return EventCursor(e.TxOrder, e.ID) }

// EventCursor encodes a position in a tenant's event stream.
func EventCursor(txOrder, id int64) string {
	return strconv.FormatInt(txOrder, 10) + "." + strconv.FormatInt(id, 10)
}

// ParseEventCursor decodes a cursor; "" is the start of the stream.
func ParseEventCursor(c string) (txOrder, id int64, ok bool) {
	if c == "" {
		return 0, 0, true
	}
	a, b, found := strings.Cut(c, ".")
	if !found {
		return 0, 0, false
	}
	x, err1 := strconv.ParseInt(a, 10, 64)
	y, err2 := strconv.ParseInt(b, 10, 64)
	return x, y, err1 == nil && err2 == nil && x >= 0 && y >= 0
}

// InsertEvent appends an event in the current transaction, so it commits or
// rolls back with the change it describes.
func (t *Tx) InsertEvent(ctx context.Context, tenantID, typ, subject string, data []byte) error {
	_, err := t.exec(ctx, "INSERT INTO events (tenant_id, type, subject, data, created_ms) VALUES (?, ?, ?, ?, compute_now())",
		tenantID, typ, subject, string(data))
	if err != nil {
		return fmt.Errorf("insert event: %w", err)
	}
	return nil
}

// ListEvents reads a tenant's events after the cursor position, in commit
// order. On PostgreSQL only events of transactions older than every running
// one are returned, so an event that commits late is never skipped.
func (t *Tx) ListEvents(ctx context.Context, tenantID string, afterTx, afterID int64, typePrefix string, limit int) ([]Event, error) {
	q := `SELECT id, tx_order, tenant_id, type, subject, data, created_ms FROM events
		WHERE tenant_id = ? AND (tx_order > ? OR (tx_order = ? AND id > ?)) AND (? = '' OR type LIKE ?)`
	if t.db.dialect == Postgres {
		q += " AND tx_order < pg_snapshot_xmin(pg_current_snapshot())::TEXT::BIGINT"
	}
	q += " ORDER BY tx_order, id LIMIT ?"
	rows, err := t.query(ctx, q, tenantID, afterTx, afterTx, afterID, typePrefix, escapeLike(typePrefix)+"%", limit)
	if err != nil {
		return nil, fmt.Errorf("list events: %w", err)
	}
	defer rows.Close()
	var out []Event
	for rows.Next() {
		var e Event
		var data string
		var created int64
		if err := rows.Scan(&e.ID, &e.TxOrder, &e.TenantID, &e.Type, &e.Subject, &data, &created); err != nil {
			return nil, err
		}
		e.Data, e.CreatedAt = []byte(data), fromMS(created)
		out = append(out, e)
	}
	return out, rows.Err()
}

// escapeLike drops LIKE's wildcards; event types use neither.
func escapeLike(s string) string {
	return strings.NewReplacer("%", "", "_", "").Replace(s)
}

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

// InsertAudit writes an audit row in the current transaction.
func (t *Tx) InsertAudit(ctx context.Context, a AuditEntry) error {
	_, err := t.exec(ctx, "INSERT INTO audit (tenant_id, actor, action, resource, data, created_ms) VALUES (?, ?, ?, ?, ?, compute_now())",
		a.TenantID, a.Actor, a.Action, a.Resource, string(a.Data))
	if err != nil {
		return fmt.Errorf("insert audit: %w", err)
	}
	return nil
}

// ListAudit reads a tenant's audit rows, newest first, with ids below
// `before` (0: from the newest).
func (t *Tx) ListAudit(ctx context.Context, tenantID string, before int64, limit int) ([]AuditEntry, error) {
	rows, err := t.query(ctx, `SELECT id, tenant_id, actor, action, resource, data, created_ms FROM audit
		WHERE tenant_id = ? AND (? = 0 OR id < ?) ORDER BY id DESC LIMIT ?`, tenantID, before, before, limit)
	if err != nil {
		return nil, fmt.Errorf("list audit: %w", err)
	}
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

// WaitEventsVisible waits until every committed event of the tenant is
// visible to ListEvents. On PostgreSQL, ListEvents hides events while any
// older transaction in the database still runs (so cursors never skip); a
// reader that must see everything already committed, such as a test that
// counts events right after an action, waits here first. SQLite needs no
// wait.
func (db *DB) WaitEventsVisible(ctx context.Context, tenantID string, timeout time.Duration) error {
	if db.dialect != Postgres {
		return nil
	}
	deadline := time.Now().Add(timeout)
	for {
		var all, visible int64
		err := db.ReadTx(ctx, func(t *Tx) error {
			if err := t.queryRow(ctx, "SELECT COALESCE(MAX(id), 0) FROM events WHERE tenant_id = ?", tenantID).Scan(&all); err != nil {
				return err
			}
			return t.queryRow(ctx, "SELECT COALESCE(MAX(id), 0) FROM events WHERE tenant_id = ? AND tx_order < pg_snapshot_xmin(pg_current_snapshot())::TEXT::BIGINT", tenantID).Scan(&visible)
		})
		if err != nil {
			return fmt.Errorf("wait for events: %w", err)
		}
		if visible >= all {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("events of %s still invisible after %v", tenantID, timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
