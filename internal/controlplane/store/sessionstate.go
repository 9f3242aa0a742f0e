package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// HeldSession names a session a replica holds: the node, the session id
// it connected with, and the serial of the certificate it authenticated
// with.
type HeldSession struct {
	NodeID    string
	SessionID string
	Serial    string
}

// SessionState is what the database says about a held session's node and
// certificate now.
type SessionState struct {
	NodeID string
	// NodeFound is false when the node row is gone.
	NodeFound bool
	// SessionID is the session the node is connected by (another
	// replica's when a newer session took over).
	SessionID          string
	State              string
	IdentityGeneration int
	// CertFound is false when the held serial is not a certificate of
	// the node.
	CertFound      bool
	CertGeneration int
	CertRevoked    bool
	// CertSupersededAt is when a renewal superseded the certificate (nil:
	// it is the node's newest).
	CertSupersededAt *time.Time
}

// sessionChunks are the IN-list sizes SessionStates pads to, so the
// statement caches hold three texts, not one per count.
var sessionChunks = []int{16, 128, 1024}

// SessionStates reads, for each held session, its node's session, state
// and identity generation and its certificate's generation and revocation,
// in one query per 1024 sessions (the session service's check that ends a
// session within a second of a reclaim, revocation or retirement made by
// any replica, R12.1). The answer is in the order of held.
func (t *Tx) SessionStates(ctx context.Context, held []HeldSession) ([]SessionState, error) {
	out := make([]SessionState, 0, len(held))
	for len(held) > 0 {
		n := sessionChunks[len(sessionChunks)-1]
		for _, c := range sessionChunks {
			if len(held) <= c {
				n = c
				break
			}
		}
		chunk := held[:min(n, len(held))]
		held = held[len(chunk):]
		got, err := t.sessionStates(ctx, chunk, n)
		if err != nil {
			return nil, err
		}
		out = append(out, got...)
	}
	return out, nil
}

func (t *Tx) sessionStates(ctx context.Context, held []HeldSession, size int) ([]SessionState, error) {
	marks := strings.TrimSuffix(strings.Repeat("?, ", size), ", ")
	// Serials (the ON clause) first, then node ids. Padding never
	// matches: no node id or serial is empty.
	args := make([]any, 0, 2*size)
	for i := range size {
		if i < len(held) {
			args = append(args, held[i].Serial)
		} else {
			args = append(args, "")
		}
	}
	for i := range size {
		if i < len(held) {
			args = append(args, held[i].NodeID)
		} else {
			args = append(args, "")
		}
	}
	rows, err := t.query(ctx, `SELECT n.id, n.session_id, n.state, n.identity_generation, c.serial, c.identity_generation, c.revoked_ms, c.superseded_ms
		FROM nodes n LEFT JOIN node_certs c ON c.node_id = n.id AND c.serial IN (`+marks+`)
		WHERE n.id IN (`+marks+`)`, args...)
	if err != nil {
		return nil, fmt.Errorf("read held sessions: %w", err)
	}
	defer rows.Close()
	byNode := map[string]SessionState{}
	for rows.Next() {
		var s SessionState
		var serial sql.NullString
		var certGen, revoked, superseded sql.NullInt64
		if err := rows.Scan(&s.NodeID, &s.SessionID, &s.State, &s.IdentityGeneration, &serial, &certGen, &revoked, &superseded); err != nil {
			return nil, err
		}
		s.NodeFound = true
		s.CertFound, s.CertGeneration, s.CertRevoked = serial.Valid, int(certGen.Int64), revoked.Valid
		s.CertSupersededAt = fromNullMS(superseded)
		// A node has one held session here, so one serial of it in the
		// list: a second row would be another node's serial, which the
		// join condition excludes.
		byNode[s.NodeID] = s
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	out := make([]SessionState, len(held))
	for i, h := range held {
		s, ok := byNode[h.NodeID]
		if !ok {
			s = SessionState{NodeID: h.NodeID}
		}
		out[i] = s
	}
	return out, nil
}

// RequeueCommands puts a node's sent commands among ids back in the
// queue: their session ended without an answer, and the next session
// delivers them again (bcd runs a command id at most once, so a second
// delivery of one it already ran is answered, not run). When any went
// back, the node's session is told once the transaction commits, on
// whichever replica holds it (notify.go).
func (t *Tx) RequeueCommands(ctx context.Context, nodeID string, ids []string) (int, error) {
	total := 0
	for len(ids) > 0 {
		chunk := ids[:min(len(ids), 16)]
		ids = ids[len(chunk):]
		args := []any{nodeID}
		for i := range 16 {
			if i < len(chunk) {
				args = append(args, chunk[i])
			} else {
				args = append(args, "")
			}
		}
		res, err := t.exec(ctx, "UPDATE commands SET state = 'queued', sent_ms = NULL WHERE node_id = ? AND state = 'sent' AND id IN (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", args...)
		if err != nil {
			return total, fmt.Errorf("requeue commands: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, err
		}
		total += int(n)
	}
	if total > 0 {
		if err := t.commandsQueued(ctx, nodeID); err != nil {
			return total, err
		}
	}
	return total, nil
}

// RequeueSentCommands puts every command of the node that is still sent
// back in the queue, and returns how many. A new session of the node calls
// it: a command sent by an earlier session that never got an answer
// stays sent when that session's replica died before it could put it
// back (RequeueCommands), and would only expire. Delivering it again is
// safe because bcd remembers, on disk, every command id it ran and
// answers one it already ran with "replayed" instead of running it again;
// one it is still running gets the running command's answer.
func (t *Tx) RequeueSentCommands(ctx context.Context, nodeID string) (int, error) {
	res, err := t.exec(ctx, "UPDATE commands SET state = 'queued', sent_ms = NULL WHERE node_id = ? AND state = 'sent'", nodeID)
	if err != nil {
		return 0, fmt.Errorf("requeue sent commands: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	if n > 0 {
		if err := t.commandsQueued(ctx, nodeID); err != nil {
			return int(n), err
		}
	}
	return int(n), nil
}
