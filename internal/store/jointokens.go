package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// JoinToken is a join_tokens row. Only the SHA-256 of the secret is stored.
type JoinToken struct {
	ID             string
	TenantID       string
	PoolID         string
	SiteID         string
	Role           string
	SecretSHA256   []byte
	MaxUses        int
	UsesLeft       int
	Expect         []byte // JSON of hwid.Expect
	AllowReclaim   bool
	Hosted         string
	IdempotencyKey string
	CreatedBy      string
	CreatedAt      time.Time
	ExpiresAt      time.Time
	RevokedAt      *time.Time
	// Live is computed at read time: not revoked, not expired at
	// compute_now(), uses left.
	Live bool
}

const tokenCols = `id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect, allow_reclaim, hosted,
	COALESCE(idempotency_key, ''), created_by, created_ms, expires_ms, revoked_ms,
	(revoked_ms IS NULL AND expires_ms > compute_now() AND uses_left > 0)`

func scanToken(sc interface{ Scan(...any) error }) (JoinToken, error) {
	var j JoinToken
	var expect string
	var created, expires int64
	var revoked sql.NullInt64
	if err := sc.Scan(&j.ID, &j.TenantID, &j.PoolID, &j.SiteID, &j.Role, &j.SecretSHA256, &j.MaxUses, &j.UsesLeft, &expect, &j.AllowReclaim, &j.Hosted,
		&j.IdempotencyKey, &j.CreatedBy, &created, &expires, &revoked, &j.Live); err != nil {
		return JoinToken{}, err
	}
	j.Expect = []byte(expect)
	j.CreatedAt, j.ExpiresAt, j.RevokedAt = fromMS(created), fromMS(expires), fromNullMS(revoked)
	return j, nil
}

// InsertJoinToken inserts a token that expires ttl after compute_now(). A
// reused idempotency key in the tenant fails with a unique violation
// (IsUniqueViolation).
func (t *Tx) InsertJoinToken(ctx context.Context, j JoinToken, ttl time.Duration) (JoinToken, error) {
	var key sql.NullString
	if j.IdempotencyKey != "" {
		key = sql.NullString{String: j.IdempotencyKey, Valid: true}
	}
	row := t.queryRow(ctx, `INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect, allow_reclaim, hosted,
			idempotency_key, created_by, created_ms, expires_ms)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, compute_now(), compute_now() + ?)
		RETURNING `+tokenCols,
		j.ID, j.TenantID, j.PoolID, j.SiteID, j.Role, j.SecretSHA256, j.MaxUses, j.MaxUses, string(j.Expect), j.AllowReclaim, j.Hosted,
		key, j.CreatedBy, ttl.Milliseconds())
	out, err := scanToken(row)
	if err != nil {
		return JoinToken{}, fmt.Errorf("insert join token: %w", err)
	}
	return out, nil
}

// GetJoinToken reads a token.
func (t *Tx) GetJoinToken(ctx context.Context, id string) (JoinToken, error) {
	j, err := scanToken(t.queryRow(ctx, "SELECT "+tokenCols+" FROM join_tokens WHERE id = ?", id))
	return j, notFound(err)
}

// GetJoinTokenByKey reads the tenant's token created with an idempotency key.
func (t *Tx) GetJoinTokenByKey(ctx context.Context, tenantID, key string) (JoinToken, error) {
	j, err := scanToken(t.queryRow(ctx, "SELECT "+tokenCols+" FROM join_tokens WHERE tenant_id = ? AND idempotency_key = ?", tenantID, key))
	return j, notFound(err)
}

// ConsumeJoinTokenUse spends one use of a live token. It reports false when
// the token had none left, was revoked or expired at compute_now(). On
// PostgreSQL the row stays locked until the transaction ends, and a
// concurrent spender waits and re-checks the committed row: spend last and
// keep the rest of the transaction short, since a token with many uses is
// one hot row.
func (t *Tx) ConsumeJoinTokenUse(ctx context.Context, id string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ? AND uses_left > 0 AND revoked_ms IS NULL AND expires_ms > compute_now()", id)
	if err != nil {
		return false, fmt.Errorf("consume join token: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// ListJoinTokens lists a pool's tokens in id order after `after`; live only
// unless includeInactive.
func (t *Tx) ListJoinTokens(ctx context.Context, poolID string, includeInactive bool, after string, limit int) ([]JoinToken, error) {
	q := "SELECT " + tokenCols + " FROM join_tokens WHERE pool_id = ? AND id > ?"
	if !includeInactive {
		q += " AND revoked_ms IS NULL AND expires_ms > compute_now() AND uses_left > 0"
	}
	q += " ORDER BY id LIMIT ?"
	rows, err := t.query(ctx, q, poolID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list join tokens: %w", err)
	}
	defer rows.Close()
	var out []JoinToken
	for rows.Next() {
		j, err := scanToken(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, j)
	}
	return out, rows.Err()
}

// RevokeJoinToken revokes a token now, keeping the first revocation time.
// It reports whether this call revoked it (false: it was revoked already).
func (t *Tx) RevokeJoinToken(ctx context.Context, id string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE join_tokens SET revoked_ms = compute_now() WHERE id = ? AND revoked_ms IS NULL", id)
	if err != nil {
		return false, fmt.Errorf("revoke join token: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}
