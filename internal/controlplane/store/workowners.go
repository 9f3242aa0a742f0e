package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Work queue ownership. Several API replicas run controllers on one
// database; each item has one owner at a time:
//   - a controller registers as an owner (RenewWorkOwner) with a short
//     lease on the database's clock, renewed every time it claims and
//     while it processes;
//   - ClaimWorkAs takes due unowned items and the items of owners whose
//     lease expired (a replica that died mid-item), so they move within
//     the lease, not when the item's own claim runs out;
//   - FinishWork and FailWork only settle an item its claimer still owns
//     (ErrLeaseLost otherwise), so a replica that stalled past its lease
//     and woke up rolls back instead of applying the item a second time.

// ErrLeaseLost is returned when a controller settles an item another
// replica took over: its transaction must roll back.
var ErrLeaseLost = errs.New(errs.Conflict, "the work item's lease moved to another replica")

// RenewWorkOwner registers owner, or extends its lease, until ttl after
// compute_now().
func (t *Tx) RenewWorkOwner(ctx context.Context, owner string, ttl time.Duration) error {
	_, err := t.exec(ctx, `INSERT INTO work_owners (owner_id, expires_ms) VALUES (?, compute_now() + ?)
		ON CONFLICT (owner_id) DO UPDATE SET expires_ms = excluded.expires_ms`, owner, ttl.Milliseconds())
	if err != nil {
		return fmt.Errorf("renew work owner: %w", err)
	}
	return nil
}

// ReleaseWorkOwner ends owner's lease (a controller stopping cleanly): its
// items can be claimed at once. It also forgets owners whose lease ended
// over an hour ago.
func (t *Tx) ReleaseWorkOwner(ctx context.Context, owner string) error {
	_, err := t.exec(ctx, "DELETE FROM work_owners WHERE owner_id = ? OR expires_ms < compute_now() - 3600000", owner)
	if err != nil {
		return fmt.Errorf("release work owner: %w", err)
	}
	return nil
}

// ClaimWorkAs takes up to limit items for owner: due items nobody owns and
// items whose owner's lease expired. It records owner on them ("" records
// none), counts an attempt and pushes not_before_ms back by lease, which
// is when an ownerless claim (or an older replica's) comes back.
// PostgreSQL replicas skip each other's locked rows.
func (t *Tx) ClaimWorkAs(ctx context.Context, owner string, limit int, lease time.Duration) ([]WorkItem, error) {
	q := `SELECT id, kind, node_id, attempts FROM work_queue
		WHERE (owner IS NULL AND not_before_ms <= compute_now())
		   OR (owner IS NOT NULL AND NOT EXISTS (SELECT 1 FROM work_owners o WHERE o.owner_id = work_queue.owner AND o.expires_ms > compute_now()))
		ORDER BY not_before_ms, id LIMIT ?`
	if t.db.dialect == Postgres {
		q += " FOR UPDATE SKIP LOCKED"
	}
	rows, err := t.query(ctx, q, limit)
	if err != nil {
		return nil, fmt.Errorf("claim work: %w", err)
	}
	var items []WorkItem
	for rows.Next() {
		w := WorkItem{Owner: owner}
		if err := rows.Scan(&w.ID, &w.Kind, &w.NodeID, &w.Attempts); err != nil {
			rows.Close()
			return nil, err
		}
		items = append(items, w)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var o any
	if owner != "" {
		o = owner
	}
	for _, w := range items {
		if _, err := t.exec(ctx, "UPDATE work_queue SET not_before_ms = compute_now() + ?, attempts = attempts + 1, owner = ? WHERE id = ?",
			lease.Milliseconds(), o, w.ID); err != nil {
			return nil, fmt.Errorf("claim work: %w", err)
		}
	}
	return items, nil
}

// ownedRow turns a settling statement's outcome into ErrLeaseLost when it
// touched no row (the item was taken over, or settled by its new owner).
func ownedRow(res sql.Result, err error) error {
	if err != nil {
		return fmt.Errorf("settle work: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n == 0 {
		return ErrLeaseLost
	}
	return nil
}
