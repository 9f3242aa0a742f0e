package store

import (
	"context"
	"fmt"
	"time"
)

// UseRenewProof records a renewal proof (R13.2) and reports whether it is
// fresh: false means the same proof was recorded before and has not expired
// yet, a replay. Expired rows are pruned first, so a proof may be used again
// once its window passed (the client-time check refuses it by then anyway).
//
// now is the caller's clock (JoinService's injected clock, the one the
// client-time window is checked against), not compute_now(): the two
// windows must be measured by the same clock.
//
// Two transactions racing with one proof meet at the primary key: on
// PostgreSQL the second waits for the first and then inserts nothing; on
// SQLite writers are serial.
func (t *Tx) UseRenewProof(ctx context.Context, proofHash []byte, nodeID string, now time.Time, ttl time.Duration) (fresh bool, err error) {
	if _, err := t.exec(ctx, "DELETE FROM renew_proofs WHERE expires_ms <= ?", ms(now)); err != nil {
		return false, fmt.Errorf("prune renew proofs: %w", err)
	}
	res, err := t.exec(ctx, "INSERT INTO renew_proofs (proof_sha256, node_id, expires_ms) VALUES (?, ?, ?) ON CONFLICT (proof_sha256) DO NOTHING",
		proofHash, nodeID, ms(now.Add(ttl)))
	if err != nil {
		if IsUniqueViolation(err) {
			return false, nil
		}
		return false, fmt.Errorf("record renew proof: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("record renew proof: %w", err)
	}
	return n == 1, nil
}

// RevokeNodeCert revokes one certificate by serial, unless it already is
// revoked. It reports whether it revoked it.
func (t *Tx) RevokeNodeCert(ctx context.Context, serial, reason string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE node_certs SET revoked_ms = compute_now(), revoke_reason = ? WHERE serial = ? AND revoked_ms IS NULL", reason, serial)
	if err != nil {
		return false, fmt.Errorf("revoke node cert: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("revoke node cert: %w", err)
	}
	return n == 1, nil
}
