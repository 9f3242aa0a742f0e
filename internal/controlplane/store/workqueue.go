package store

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// workSignal wakes a controller once a transaction that queued work, or
// made it due, committed. Its zero value is ready.
type workSignal struct {
	once sync.Once
	ch   chan struct{}
}

func (s *workSignal) c() chan struct{} {
	s.once.Do(func() { s.ch = make(chan struct{}, 1) })
	return s.ch
}

func (s *workSignal) notify() {
	select {
	case s.c() <- struct{}{}:
	default:
	}
}

// WorkQueued receives once work was queued or made due in this process
// since it last received (many commits, one receive), so the controller
// claims only when there is something to claim; work queued by other
// replicas is found by the controller's poll.
func (db *DB) WorkQueued() <-chan struct{} { return db.work.c() }

// WorkItem is a work_queue row.
type WorkItem struct {
	ID       int64
	Kind     string
	NodeID   string
	Attempts int
	// Owner is the controller that claimed it (ClaimWorkAs), "" for none.
	Owner string
}

// EnqueueWork queues work for the controllers.
func (t *Tx) EnqueueWork(ctx context.Context, kind, nodeID string) error {
	err := t.execLater(ctx, "INSERT INTO work_queue (kind, node_id, not_before_ms, created_ms) VALUES (?, ?, compute_now(), compute_now())", kind, nodeID)
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", kind, err)
	}
	t.AfterCommit(t.db.work.notify)
	return nil
}

// EnqueueWorkOnce queues work unless an item of that kind for the node is
// already queued; an existing item is made due now. It reports whether it
// inserted a new item.
func (t *Tx) EnqueueWorkOnce(ctx context.Context, kind, nodeID string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE work_queue SET not_before_ms = compute_now() WHERE kind = ? AND node_id = ?", kind, nodeID)
	if err != nil {
		return false, fmt.Errorf("enqueue %s: %w", kind, err)
	}
	if n, err := res.RowsAffected(); err != nil || n > 0 {
		if n > 0 {
			t.AfterCommit(t.db.work.notify)
		}
		return false, err
	}
	return true, t.EnqueueWork(ctx, kind, nodeID)
}

// WakeNodeWork makes a node's queued work items due now (a command result
// arrived).
func (t *Tx) WakeNodeWork(ctx context.Context, nodeID string) error {
	res, err := t.exec(ctx, "UPDATE work_queue SET not_before_ms = compute_now() WHERE node_id = ?", nodeID)
	if err != nil {
		return err
	}
	if n, _ := res.RowsAffected(); n > 0 {
		t.AfterCommit(t.db.work.notify)
	}
	return nil
}

// ClaimWork claims like ClaimWorkAs for no owner: the items come back
// when lease ran out.
func (t *Tx) ClaimWork(ctx context.Context, limit int, lease time.Duration) ([]WorkItem, error) {
	return t.ClaimWorkAs(ctx, "", limit, lease)
}

// FinishWork removes a done item; an owned item only while its claimer
// still owns it (else ErrLeaseLost, see workowners.go).
func (t *Tx) FinishWork(ctx context.Context, w WorkItem) error {
	res, err := t.exec(ctx, "DELETE FROM work_queue WHERE id = ? AND COALESCE(owner, '') = ?", w.ID, w.Owner)
	return ownedRow(res, err)
}

// FailWork records an error and retries the item after backoff, releasing
// it; an owned item only while its claimer still owns it (else
// ErrLeaseLost).
func (t *Tx) FailWork(ctx context.Context, w WorkItem, msg string, backoff time.Duration) error {
	res, err := t.exec(ctx, "UPDATE work_queue SET last_error = ?, not_before_ms = compute_now() + ?, owner = NULL WHERE id = ? AND COALESCE(owner, '') = ?",
		msg, backoff.Milliseconds(), w.ID, w.Owner)
	return ownedRow(res, err)
}

// NodeWork lists a node's queued work items (tests, diagnostics).
func (t *Tx) NodeWork(ctx context.Context, nodeID string) ([]WorkItem, error) {
	rows, err := t.query(ctx, "SELECT id, kind, node_id, attempts FROM work_queue WHERE node_id = ? ORDER BY id", nodeID)
	if err != nil {
		return nil, fmt.Errorf("node work: %w", err)
	}
	defer rows.Close()
	var out []WorkItem
	for rows.Next() {
		var w WorkItem
		if err := rows.Scan(&w.ID, &w.Kind, &w.NodeID, &w.Attempts); err != nil {
			return nil, err
		}
		out = append(out, w)
	}
	return out, rows.Err()
}
