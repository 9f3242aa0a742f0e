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

// EventRow is an event to append: Data is JSON.
type EventRow struct {
	TenantID string
	Type     string
	Subject  string
	Data     []byte
}

var eventInsert = newMultiInsert("INSERT INTO events (tenant_id, type, subject, data, created_ms) VALUES", "(?, ?, ?, ?, compute_now())")

// InsertEvent appends an event in the current transaction, so it commits or
// rolls back with the change it describes. On SQLite, whose one writer
// commits in id order, it is readable at commit (tx_order stays 0); on
// PostgreSQL once the sequencer has given it its position (sequencer.go).
func (t *Tx) InsertEvent(ctx context.Context, tenantID, typ, subject string, data []byte) error {
	return t.InsertEvents(ctx, EventRow{TenantID: tenantID, Type: typ, Subject: subject, Data: data})
}

// InsertEvents appends events as InsertEvent does, in the order given (their
// ids ascend in it), in one statement per maxInsertRows of them.
func (t *Tx) InsertEvents(ctx context.Context, rows ...EventRow) error {
	err := t.insertRows(ctx, eventInsert, len(rows), 4, func(args []any, i int) []any {
		r := rows[i]
		return append(args, r.TenantID, r.Type, r.Subject, string(r.Data))
	})
	if err != nil {
		return fmt.Errorf("insert event: %w", err)
	}
	if len(rows) > 0 {
		t.events = true
	}
	return nil
}

// ListEvents reads a tenant's events after the cursor position (tx_order,
// id), in commit order. It never returns an event at a position before one
// it returned earlier: SQLite's single writer commits in id order, and on
// PostgreSQL events get their position only after they committed (the
// sequencer) and are hidden until then (tx_order NULL matches nothing).
func (t *Tx) ListEvents(ctx context.Context, tenantID string, afterTx, afterID int64, typePrefix string, limit int) ([]Event, error) {
	q := `SELECT ` + eventCols + ` FROM events
		WHERE tenant_id = ? AND (tx_order > ? OR (tx_order = ? AND id > ?)) AND (? = '' OR type LIKE ?)
		ORDER BY tx_order, id LIMIT ?`
	rows, err := t.query(ctx, q, tenantID, afterTx, afterTx, afterID, typePrefix, escapeLike(typePrefix)+"%", limit)
	if err != nil {
		return nil, fmt.Errorf("list events: %w", err)
	}
	return scanEvents(rows)
}

// eventCols are the columns scanEvents reads, in its order.
const eventCols = "id, tx_order, tenant_id, type, subject, data, created_ms"

// scanEvents reads every event of rows and closes them.
func scanEvents(rows Rows) ([]Event, error) {
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

// WaitEventsVisible waits until every event of the tenant committed so far
// is readable by ListEvents: on PostgreSQL until the sequencer has numbered
// it; SQLite needs no wait. A reader that must see everything already
// committed, such as a test that counts events right after an action,
// waits here first.
func (db *DB) WaitEventsVisible(ctx context.Context, tenantID string, timeout time.Duration) error {
	if db.dialect != Postgres {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := db.SequenceEvents(ctx); err != nil {
		return fmt.Errorf("events of %s still invisible after %v: %w", tenantID, timeout, err)
	}
	return nil
}
