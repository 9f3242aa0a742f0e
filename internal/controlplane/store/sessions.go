package store

import (
	"context"
	"fmt"
)

// Node connection states (nodes.connection).
const (
	Connected    = "connected"
	Disconnected = "disconnected"
)

// ConnectNode marks a node connected by session sessionID (R12.1) and
// reports whether the node was disconnected before.
func (t *Tx) ConnectNode(ctx context.Context, nodeID, sessionID string) (wasConnected bool, err error) {
	var prev string
	if err := t.queryRow(ctx, "SELECT connection FROM nodes WHERE id = ?", nodeID).Scan(&prev); err != nil {
		return false, notFound(err)
	}
	if _, err := t.exec(ctx, "UPDATE nodes SET connection = 'connected', session_id = ?, last_seen_ms = compute_now() WHERE id = ?", sessionID, nodeID); err != nil {
		return false, fmt.Errorf("connect node: %w", err)
	}
	return prev == Connected, nil
}

// DisconnectNode marks a node disconnected when sessionID is still the
// session that connected it; it reports whether it did.
func (t *Tx) DisconnectNode(ctx context.Context, nodeID, sessionID string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE nodes SET connection = 'disconnected', session_id = '', last_seen_ms = compute_now() WHERE id = ? AND session_id = ?", nodeID, sessionID)
	if err != nil {
		return false, fmt.Errorf("disconnect node: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// TouchNode records a heartbeat of session sessionID. It reports false when
// the session no longer speaks for the node: another session took over,
// the identity generation moved (a reclaim) or the node was retired.
func (t *Tx) TouchNode(ctx context.Context, nodeID, sessionID string, generation int) (bool, error) {
	res, err := t.exec(ctx, "UPDATE nodes SET last_seen_ms = compute_now() WHERE id = ? AND session_id = ? AND identity_generation = ? AND state <> 'retired'",
		nodeID, sessionID, generation)
	if err != nil {
		return false, fmt.Errorf("touch node: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// DisconnectAll marks every node disconnected and returns how many were
// connected: after a restore no session of the backup's time is held by
// any process, and the nodes reconnect as they notice.
func (t *Tx) DisconnectAll(ctx context.Context) (int64, error) {
	res, err := t.exec(ctx, "UPDATE nodes SET connection = 'disconnected', session_id = '' WHERE connection = 'connected'")
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
