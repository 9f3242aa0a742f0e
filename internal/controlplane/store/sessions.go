package store

import (
	"context"
	"fmt"
	"strings"
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

// touchSizes are the list sizes TouchNodes pads to (padding rows match no
// node), so the statement caches hold three texts, not one per count.
var touchSizes = []int{1, 16, 128}

// touchTexts are TouchNodes' statements, by list size.
var touchTexts = func() map[int]string {
	texts := map[int]string{}
	for _, n := range touchSizes {
		rows := strings.TrimSuffix(strings.Repeat("(?, ?, CAST(? AS INTEGER)), ", n), ", ")
		texts[n] = `WITH held (node_id, session_id, gen) AS (VALUES ` + rows + `)
		UPDATE nodes SET last_seen_ms = compute_now() FROM held
		WHERE nodes.id = held.node_id AND nodes.session_id = held.session_id AND nodes.identity_generation = held.gen AND nodes.state <> 'retired'
		RETURNING nodes.id`
	}
	return texts
}()

// TouchNodes records a heartbeat (last_seen) of each of the sessions, in
// one statement per 128 sessions, when the session still speaks for its
// node, and returns the node ids of the sessions that no longer do: another
// session took over, the identity generation moved (a reclaim), the node
// was retired or is gone.
func (t *Tx) TouchNodes(ctx context.Context, held []HeldSession) ([]string, error) {
	touched := make(map[string]bool, len(held))
	for rest := held; len(rest) > 0; {
		size := touchSizes[len(touchSizes)-1]
		for _, n := range touchSizes {
			if len(rest) <= n {
				size = n
				break
			}
		}
		chunk := rest[:min(len(rest), size)]
		rest = rest[len(chunk):]
		args := make([]any, 0, 3*size)
		for i := range size {
			if i < len(chunk) {
				args = append(args, chunk[i].NodeID, chunk[i].SessionID, chunk[i].Generation)
			} else {
				args = append(args, "", "", 0)
			}
		}
		rows, err := t.query(ctx, touchTexts[size], args...)
		if err != nil {
			return nil, fmt.Errorf("touch nodes: %w", err)
		}
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return nil, fmt.Errorf("touch nodes: %w", err)
			}
			touched[id] = true
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return nil, fmt.Errorf("touch nodes: %w", err)
		}
	}
	var stale []string
	for _, h := range held {
		if !touched[h.NodeID] {
			stale = append(stale, h.NodeID)
		}
	}
	return stale, nil
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
