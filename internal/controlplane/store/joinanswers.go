package store

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// JoinAnswer is a join_answers row: the answer JoinService gave one join
// request, kept by the request's digest (pki.JoinRequestDigest) so that the
// same request arriving again gets it back and spends nothing (R4.9).
type JoinAnswer struct {
	// RequestDigest is the request's digest, the key.
	RequestDigest []byte
	// NodeID is the node the answer admitted ("" for an answer that
	// admitted none, such as a deferral).
	NodeID string
	// Response is the answer as sent (a serialized, signed JoinResponse).
	Response []byte
	// TTL is how long after compute_now() the answer is kept; used by
	// InsertJoinAnswer only.
	TTL time.Duration
	// CreatedAt and ExpiresAt are read back, on the database's clock.
	CreatedAt time.Time
	ExpiresAt time.Time
}

// GetJoinAnswer reads the answer stored for a request digest. It returns
// ErrNotFound when there is none or it expired at compute_now().
func (t *Tx) GetJoinAnswer(ctx context.Context, digest []byte) (JoinAnswer, error) {
	var a JoinAnswer
	var created, expires int64
	err := t.queryRow(ctx, `SELECT request_digest, node_id, response, created_ms, expires_ms FROM join_answers
		WHERE request_digest = ? AND expires_ms > compute_now()`, digest).
		Scan(&a.RequestDigest, &a.NodeID, &a.Response, &created, &expires)
	if err != nil {
		return JoinAnswer{}, notFound(err)
	}
	a.CreatedAt, a.ExpiresAt = fromMS(created), fromMS(expires)
	return a, nil
}

// InsertJoinAnswer stores an answer that expires a.TTL after compute_now().
// A live answer for the same digest makes the transaction fail with a unique
// violation (IsUniqueViolation): two transactions admitting one request
// race, and the loser rolls back and reads the winner's answer. An expired
// answer for the digest is replaced. On SQLite InsertJoinAnswer itself
// reports the violation; on PostgreSQL the insert is held back
// (engine/pipeline.go) and the violation is the error of the transaction's next
// statement and of the transaction. The caller must end the transaction
// after a violation, not carry on in it.
func (t *Tx) InsertJoinAnswer(ctx context.Context, a JoinAnswer) error {
	switch {
	case len(a.RequestDigest) == 0:
		return errors.New("insert join answer: no request digest")
	case a.TTL < time.Millisecond:
		return fmt.Errorf("insert join answer: TTL %s, want at least 1 ms", a.TTL)
	case a.Response == nil:
		return errors.New("insert join answer: no response")
	}
	// One statement: an expired answer for the digest is replaced in place
	// (the request sent anew), a live one is left alone and reported as the
	// unique violation it would have been. It is held back (execLaterRows):
	// on PostgreSQL it goes in one batch with the join's next statement,
	// the spend, and its violation is then the transaction's error.
	return t.execLaterRows(ctx, "insert join answer", 1, errUniqueViolation, `INSERT INTO join_answers (request_digest, node_id, response, created_ms, expires_ms)
		VALUES (?, ?, ?, compute_now(), compute_now() + ?)
		ON CONFLICT (request_digest) DO UPDATE SET node_id = excluded.node_id, response = excluded.response,
			created_ms = excluded.created_ms, expires_ms = excluded.expires_ms
		WHERE join_answers.expires_ms <= compute_now()`,
		a.RequestDigest, a.NodeID, a.Response, a.TTL.Milliseconds())
}

// DeleteExpiredJoinAnswers deletes up to limit answers expired at
// compute_now(), oldest first, and reports how many it deleted. Batches keep
// each transaction short; call it until it deletes fewer than limit.
func (t *Tx) DeleteExpiredJoinAnswers(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	res, err := t.exec(ctx, `DELETE FROM join_answers WHERE request_digest IN (
		SELECT request_digest FROM join_answers WHERE expires_ms <= compute_now() ORDER BY expires_ms LIMIT ?)`, limit)
	if err != nil {
		return 0, fmt.Errorf("delete expired join answers: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete expired join answers: %w", err)
	}
	return int(n), nil
}

// CountJoinAnswers counts the stored answers, expired ones included (they
// stay until DeleteExpiredJoinAnswers removes them).
func (t *Tx) CountJoinAnswers(ctx context.Context) (int, error) {
	var n int
	if err := t.queryRow(ctx, "SELECT COUNT(*) FROM join_answers").Scan(&n); err != nil {
		return 0, fmt.Errorf("count join answers: %w", err)
	}
	return n, nil
}
