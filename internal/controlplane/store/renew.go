package store

import (
	"context"
	"fmt"
	"time"
)

// UseRenewProof records a renewal proof (R13.2) and reports whether it is
// fresh: false means the same proof was recorded before and has not expired
// yet, a replay. A proof whose record expired may be used again (the
// client-time check refuses it by then anyway): the insert replaces an
// expired record in place and leaves a live one alone, so the check needs
// no expired row to be gone. Expired rows are deleted in batches by the
// controller's prune (DeleteExpiredRenewProofs), not by each renewal.
//
// now is the caller's clock (JoinService's injected clock, the one the
// client-time window is checked against), not compute_now(): the two
// windows must be measured by the same clock.
//
// Two transactions racing with one proof meet at the primary key: on
// PostgreSQL the second waits for the first and then re-checks the row it
// committed, which is live, so it changes nothing; on SQLite writers are
// serial.
func (t *Tx) UseRenewProof(ctx context.Context, proofHash []byte, nodeID string, now time.Time, ttl time.Duration) (fresh bool, err error) {
	res, err := t.exec(ctx, `INSERT INTO renew_proofs (proof_sha256, node_id, expires_ms) VALUES (?, ?, ?)
		ON CONFLICT (proof_sha256) DO UPDATE SET node_id = excluded.node_id, expires_ms = excluded.expires_ms
		WHERE renew_proofs.expires_ms <= ?`,
		proofHash, nodeID, ms(now.Add(ttl)), ms(now))
	if err != nil {
		return false, fmt.Errorf("record renew proof: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("record renew proof: %w", err)
	}
	return n == 1, nil
}

// DeleteExpiredRenewProofs deletes up to limit renewal proofs that expired
// at or before `before` (on the clock UseRenewProof was given), oldest
// first, and reports how many it deleted. Batches keep each transaction
// short; call it until it deletes fewer than limit.
//
// The expiry is checked on the deleted row itself, not only in the
// subquery that picks the batch: on PostgreSQL a renewal may refresh a
// picked row concurrently (UseRenewProof replacing an expired record), and
// the re-check after waiting for it must see the row live again and keep
// it, or a replay of that fresh proof would pass.
func (t *Tx) DeleteExpiredRenewProofs(ctx context.Context, before time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	res, err := t.exec(ctx, `DELETE FROM renew_proofs WHERE expires_ms <= ? AND proof_sha256 IN (
		SELECT proof_sha256 FROM renew_proofs WHERE expires_ms <= ? ORDER BY expires_ms LIMIT ?)`, ms(before), ms(before), limit)
	if err != nil {
		return 0, fmt.Errorf("delete expired renew proofs: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, fmt.Errorf("delete expired renew proofs: %w", err)
	}
	return int(n), nil
}

// CountRenewProofs counts the recorded renewal proofs, expired ones
// included.
func (t *Tx) CountRenewProofs(ctx context.Context) (int, error) {
	var n int
	if err := t.queryRow(ctx, "SELECT COUNT(*) FROM renew_proofs").Scan(&n); err != nil {
		return 0, fmt.Errorf("count renew proofs: %w", err)
	}
	return n, nil
}
