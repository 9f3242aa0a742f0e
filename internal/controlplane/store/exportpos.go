package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Export: the lease that lets one API replica at a time ship events and
// audit rows to external sinks, each sink's acknowledged position, and the
// reads across tenants that the exporter pages with
// (internal/controlplane/export owns the loop).
//
// Positions are global, never a tenant's cursor. Events are read in stream
// order (tx_order, id), gapless on both dialects (events.go, sequencer.go).
// Audit rows are read in (order, id): on SQLite order is 0 and id order is
// commit order; on PostgreSQL order is the writing transaction's id and
// only rows of transactions older than every one still running are read
// (pg_snapshot_xmin), so a row that commits late is never passed over.
// Consequence: a transaction left open anywhere in the cluster holds the
// audit export back (never the events), until it ends.

// ExportLease is the one lease name the exporter takes.
const ExportLease = "export"

// ErrExportLeaseLost is returned when a position is committed by a holder
// whose lease expired or moved: it must stop and take the lease again.
var ErrExportLeaseLost = errors.New("the export lease moved to another replica")

// ExportPosition is what a sink acknowledged: the position just after the
// last event (EventOrder, EventID) and audit row (AuditOrder, AuditID).
type ExportPosition struct {
	EventOrder, EventID int64
	AuditOrder, AuditID int64
}

// ExportAudit is an audit row with its export order.
type ExportAudit struct {
	AuditEntry
	Order int64
}

// TakeExportLease takes or renews the named lease for holder until ttl
// after compute_now(). It reports false, and changes nothing, when
// another holder's lease has not expired.
func (t *Tx) TakeExportLease(ctx context.Context, name, holder string, ttl time.Duration) (bool, error) {
	res, err := t.exec(ctx, `INSERT INTO export_leases (name, holder, expires_ms) VALUES (?, ?, compute_now() + ?)
		ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, expires_ms = excluded.expires_ms
		WHERE export_leases.holder = excluded.holder OR export_leases.expires_ms <= compute_now()`,
		name, holder, ttl.Milliseconds())
	if err != nil {
		return false, fmt.Errorf("take export lease: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, err
	}
	return n == 1, nil
}

// ReleaseExportLease ends holder's lease (a clean stop), so another
// replica takes it at once.
func (t *Tx) ReleaseExportLease(ctx context.Context, name, holder string) error {
	if _, err := t.exec(ctx, "DELETE FROM export_leases WHERE name = ? AND holder = ?", name, holder); err != nil {
		return fmt.Errorf("release export lease: %w", err)
	}
	return nil
}

// ReadExportPosition reads the sink's position; a sink never acknowledged
// is at the start.
func (t *Tx) ReadExportPosition(ctx context.Context, sink string) (ExportPosition, error) {
	var p ExportPosition
	err := t.queryRow(ctx, "SELECT event_order, event_id, audit_order, audit_id FROM export_positions WHERE sink = ?", sink).
		Scan(&p.EventOrder, &p.EventID, &p.AuditOrder, &p.AuditID)
	if errors.Is(err, sql.ErrNoRows) {
		return ExportPosition{}, nil
	}
	if err != nil {
		return p, fmt.Errorf("read export position: %w", err)
	}
	return p, nil
}

// CommitExportPosition records what the sink acknowledged, if holder still
// holds the lease (ErrExportLeaseLost otherwise). On PostgreSQL the lease
// row stays locked until commit, so a takeover waits for this commit and
// then reads the position it wrote.
func (t *Tx) CommitExportPosition(ctx context.Context, lease, holder, sink string, p ExportPosition) error {
	q := "SELECT COUNT(*) FROM export_leases WHERE name = ? AND holder = ? AND expires_ms > compute_now()"
	if t.db.dialect == Postgres {
		q = "SELECT 1 FROM export_leases WHERE name = ? AND holder = ? AND expires_ms > compute_now() FOR UPDATE"
	}
	var held int
	err := t.queryRow(ctx, q, lease, holder).Scan(&held)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && held == 0) {
		return ErrExportLeaseLost
	}
	if err != nil {
		return fmt.Errorf("check export lease: %w", err)
	}
	_, err = t.exec(ctx, `INSERT INTO export_positions (sink, event_order, event_id, audit_order, audit_id, updated_ms)
		VALUES (?, ?, ?, ?, ?, compute_now())
		ON CONFLICT (sink) DO UPDATE SET event_order = excluded.event_order, event_id = excluded.event_id,
			audit_order = excluded.audit_order, audit_id = excluded.audit_id, updated_ms = excluded.updated_ms`,
		sink, p.EventOrder, p.EventID, p.AuditOrder, p.AuditID)
	if err != nil {
		return fmt.Errorf("commit export position: %w", err)
	}
	return nil
}

// ExportEvents reads up to limit events of every tenant after the position
// (afterOrder, afterID), in stream order.
func (t *Tx) ExportEvents(ctx context.Context, afterOrder, afterID int64, limit int) ([]Event, error) {
	rows, err := t.query(ctx, `SELECT `+eventCols+` FROM events
		WHERE tx_order > ? OR (tx_order = ? AND id > ?) ORDER BY tx_order, id LIMIT ?`, afterOrder, afterOrder, afterID, limit)
	if err != nil {
		return nil, fmt.Errorf("export events: %w", err)
	}
	return scanEvents(rows)
}

// ExportAuditRows reads up to limit audit rows of every tenant after the
// position (afterOrder, afterID), in export order (see above).
func (t *Tx) ExportAuditRows(ctx context.Context, afterOrder, afterID int64, limit int) ([]ExportAudit, error) {
	q := `SELECT 0, ` + auditCols + ` FROM audit WHERE id > ? ORDER BY id LIMIT ?`
	args := []any{afterID, limit}
	if t.db.dialect == Postgres {
		// One statement: the horizon is that of the snapshot that reads.
		// Rows from before migration 00020 have no writer_xid: 0, first.
		q = `SELECT COALESCE(writer_xid, 0), ` + auditCols + ` FROM audit
			WHERE (COALESCE(writer_xid, 0) > ? OR (COALESCE(writer_xid, 0) = ? AND id > ?))
			  AND COALESCE(writer_xid, 0) < pg_snapshot_xmin(pg_current_snapshot())::TEXT::BIGINT
			ORDER BY COALESCE(writer_xid, 0), id LIMIT ?`
		args = []any{afterOrder, afterOrder, afterID, limit}
	}
	rows, err := t.query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("export audit: %w", err)
	}
	defer rows.Close()
	var out []ExportAudit
	for rows.Next() {
		var a ExportAudit
		var data string
		var created int64
		if err := rows.Scan(&a.Order, &a.ID, &a.TenantID, &a.Actor, &a.Action, &a.Resource, &data, &created); err != nil {
			return nil, err
		}
		a.Data, a.CreatedAt = []byte(data), fromMS(created)
		out = append(out, a)
	}
	return out, rows.Err()
}
