package store

import (
	"context"
	"fmt"
	"time"
)

// JoinAnswer is the answer stored for a join request (R4.9).
type JoinAnswer struct {
	RequestDigest []byte
	NodeID        string
	Response      []byte
	ExpiresAt     time.Time
}

// GetJoinAnswer reads the unexpired answer stored for a request digest.
func (t *Tx) GetJoinAnswer(ctx context.Context, digest []byte) (JoinAnswer, error) {
	var a JoinAnswer
	var exp int64
	err := t.queryRow(ctx, "SELECT request_digest, node_id, response, expires_ms FROM join_answers WHERE request_digest = ? AND expires_ms > compute_now()", digest).
		Scan(&a.RequestDigest, &a.NodeID, &a.Response, &exp)
	a.ExpiresAt = fromMS(exp)
	return a, notFound(err)
}

// InsertJoinAnswer stores the answer to a request; a second answer for the
// same digest is a unique violation.
func (t *Tx) InsertJoinAnswer(ctx context.Context, a JoinAnswer) error {
	_, err := t.exec(ctx, "INSERT INTO join_answers (request_digest, node_id, response, created_ms, expires_ms) VALUES (?, ?, ?, compute_now(), ?)",
		a.RequestDigest, a.NodeID, a.Response, ms(a.ExpiresAt))
	if err != nil {
		return fmt.Errorf("insert join answer: %w", err)
	}
	return nil
}
