package store

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"time"
)

// HeldSession names a session a replica holds: the node, the session id
// it connected with, the serial of the certificate it authenticated with,
// and the identity generation it authenticated at.
type HeldSession struct {
	NodeID     string
	SessionID  string
	Serial     string
	Generation int
}

// SessionState is what the database says about a held session's node and
// certificate now.
type SessionState struct {
	// Held is the session's index in the list ChangedSessions was given.
	Held   int
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

// sessionChunks are the list sizes ChangedSessions pads to, so the
// statement caches hold three texts, not one per count.
var sessionChunks = []int{16, 128, 1024}

// sessionChunkTexts are ChangedSessions' statements, one per chunk size.
var sessionChunkTexts = func() map[int]string {
	m := map[int]string{}
	for _, n := range sessionChunks {
		row := "(CAST(? AS INTEGER), ?, ?, ?, CAST(? AS INTEGER))"
		rows := strings.TrimSuffix(strings.Repeat(row+", ", n), ", ")
		// Only the sessions that are not live as held come back: the
		// database still looks up every node and certificate, but sends
		// and the caller scans no row for a session nothing changed.
		// Padding rows (empty node id) are skipped; no node id is empty.
		m[n] = `WITH held (i, node_id, session_id, serial, gen) AS (VALUES ` + rows + `)
		SELECT h.i, n.id, n.session_id, n.state, n.identity_generation, c.serial, c.identity_generation, c.revoked_ms, c.superseded_ms
		FROM held h
		LEFT JOIN nodes n ON n.id = h.node_id
		LEFT JOIN node_certs c ON c.serial = h.serial AND c.node_id = h.node_id
		WHERE h.node_id <> '' AND (n.id IS NULL OR n.session_id <> h.session_id OR n.state = 'retired' OR n.identity_generation <> h.gen
			OR c.serial IS NULL OR c.revoked_ms IS NOT NULL OR c.identity_generation <> h.gen OR c.superseded_ms IS NOT NULL)`
	}
	return m
}()

// ChangedSessions reads, for the held sessions, which ones the database
// no longer holds as they were opened, in one query per 1024 sessions
// (the session service's check that ends a session within a second of a
// reclaim, revocation or retirement made by any replica, R12.1). It
// returns the state of each session whose node is gone or retired, is
// connected by another session, moved to another identity generation, or
// whose certificate is not the node's, is revoked, of another generation
// or superseded by a renewal; every other held session is live as held.
// The answer is in the order of held.
//
// A replica checks every session it holds twice a second, and nearly all
// of them are live: sending and scanning a row per session was most of
// what a held session cost the API. Only the exceptions come back.
func (t *Tx) ChangedSessions(ctx context.Context, held []HeldSession) ([]SessionState, error) {
	var out []SessionState
	for base := 0; base < len(held); {
		rest := held[base:]
		n := sessionChunks[len(sessionChunks)-1]
		for _, c := range sessionChunks {
			if len(rest) <= c {
				n = c
				break
			}
		}
		chunk := rest[:min(n, len(rest))]
		got, err := t.changedSessions(ctx, chunk, base, n)
		if err != nil {
			return nil, err
		}
		out = append(out, got...)
		base += len(chunk)
	}
	return out, nil
}

func (t *Tx) changedSessions(ctx context.Context, held []HeldSession, base, size int) ([]SessionState, error) {
	args := make([]any, 0, 5*size)
	for i := range size {
		if i < len(held) {
			h := held[i]
			args = append(args, base+i, h.NodeID, h.SessionID, h.Serial, h.Generation)
		} else {
			args = append(args, -1, "", "", "", 0)
		}
	}
	rows, err := t.query(ctx, sessionChunkTexts[size], args...)
	if err != nil {
		return nil, fmt.Errorf("read held sessions: %w", err)
	}
	defer rows.Close()
	var out []SessionState
	for rows.Next() {
		var s SessionState
		var nodeID, sessionID, state, serial sql.NullString
		var nodeGen, certGen, revoked, superseded sql.NullInt64
		if err := rows.Scan(&s.Held, &nodeID, &sessionID, &state, &nodeGen, &serial, &certGen, &revoked, &superseded); err != nil {
			return nil, err
		}
		if s.Held < base || s.Held >= base+len(held) {
			return nil, fmt.Errorf("read held sessions: row for session %d of %d..%d", s.Held, base, base+len(held))
		}
		s.NodeID = held[s.Held-base].NodeID
		s.NodeFound = nodeID.Valid
		s.SessionID, s.State, s.IdentityGeneration = sessionID.String, state.String, int(nodeGen.Int64)
		s.CertFound, s.CertGeneration, s.CertRevoked = serial.Valid, int(certGen.Int64), revoked.Valid
		s.CertSupersededAt = fromNullMS(superseded)
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b SessionState) int { return a.Held - b.Held })
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
