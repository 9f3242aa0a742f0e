package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
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

// usesLeft is a token's uses left: the sum of its slots.
const usesLeft = `(SELECT COALESCE(SUM(s.uses_left), 0) FROM join_token_slots s WHERE s.token_id = join_tokens.id)`

const tokenCols = `id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, ` + usesLeft + `, expect, allow_reclaim, hosted,
	COALESCE(idempotency_key, ''), created_by, created_ms, expires_ms, revoked_ms,
	(revoked_ms IS NULL AND expires_ms > compute_now() AND ` + usesLeft + ` > 0)`

// maxSlots bounds how many rows a token's uses are split over.
const maxSlots = 16

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
	_, err := t.exec(ctx, `INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect, allow_reclaim, hosted,
			idempotency_key, created_by, created_ms, expires_ms)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, compute_now(), compute_now() + ?)`,
		j.ID, j.TenantID, j.PoolID, j.SiteID, j.Role, j.SecretSHA256, j.MaxUses, j.MaxUses, string(j.Expect), j.AllowReclaim, j.Hosted,
		key, j.CreatedBy, ttl.Milliseconds())
	if err != nil {
		return JoinToken{}, fmt.Errorf("insert join token: %w", err)
	}
	// Split the uses over up to maxSlots rows, as evenly as they go.
	slots := min(j.MaxUses, maxSlots)
	for i := 0; i < slots; i++ {
		n := j.MaxUses / slots
		if i < j.MaxUses%slots {
			n++
		}
		if _, err := t.exec(ctx, "INSERT INTO join_token_slots (token_id, slot, uses_left) VALUES (?, ?, ?)", j.ID, i, n); err != nil {
			return JoinToken{}, fmt.Errorf("insert join token slot: %w", err)
		}
	}
	out, err := t.GetJoinToken(ctx, j.ID)
	if err != nil {
		return JoinToken{}, fmt.Errorf("read new join token: %w", err)
	}
	return out, nil
}

// GetJoinToken reads a token.
func (t *Tx) GetJoinToken(ctx context.Context, id string) (JoinToken, error) {
	j, err := scanToken(t.queryRow(ctx, "SELECT "+tokenCols+" FROM join_tokens WHERE id = ?", id))
	return j, notFound(err)
}

// AdmissionToken is what a join's admission reads of a token
// (GetJoinTokenForJoin): no counts, no bookkeeping columns.
type AdmissionToken struct {
	ID           string
	TenantID     string
	PoolID       string
	SiteID       string
	Role         string
	SecretSHA256 []byte
	Expect       []byte // JSON of hwid.Expect
	AllowReclaim bool
	Hosted       string
	Revoked      bool
	// Expired is expiry at compute_now().
	Expired bool
	// HasUses reports that a slot has a use left; how many is not read.
	HasUses bool
}

// GetJoinTokenForJoin reads a token for a join's admission. Where
// GetJoinToken sums the token's slots (twice: the count and liveness), this
// asks only whether one slot has a use left, once: admission refuses a used-up
// token but never needs the count, and the spend (ConsumeJoinTokenUse)
// checks the uses itself.
func (t *Tx) GetJoinTokenForJoin(ctx context.Context, id string) (AdmissionToken, error) {
	var j AdmissionToken
	var expect string
	err := t.queryRow(ctx, `SELECT tenant_id, pool_id, site_id, role, secret_sha256, expect, allow_reclaim, hosted,
		revoked_ms IS NOT NULL, expires_ms <= compute_now(),
		EXISTS (SELECT 1 FROM join_token_slots s WHERE s.token_id = join_tokens.id AND s.uses_left > 0)
		FROM join_tokens WHERE id = ?`, id).Scan(&j.TenantID, &j.PoolID, &j.SiteID, &j.Role, &j.SecretSHA256, &expect, &j.AllowReclaim, &j.Hosted,
		&j.Revoked, &j.Expired, &j.HasUses)
	if err != nil {
		return AdmissionToken{}, notFound(err)
	}
	j.ID, j.Expect = id, []byte(expect)
	return j, nil
}

// GetJoinTokenByKey reads the tenant's token created with an idempotency key.
func (t *Tx) GetJoinTokenByKey(ctx context.Context, tenantID, key string) (JoinToken, error) {
	j, err := scanToken(t.queryRow(ctx, "SELECT "+tokenCols+" FROM join_tokens WHERE tenant_id = ? AND idempotency_key = ?", tenantID, key))
	return j, notFound(err)
}

// ConsumeJoinTokenUse spends one use of a live token. It reports false when
// the token had none left, was revoked or expired at compute_now().
//
// The uses sit in a few slot rows (join_token_slots). On PostgreSQL a spend
// takes a slot with uses left that no other transaction holds (FOR UPDATE
// SKIP LOCKED), so joins of one token proceed in parallel instead of
// queueing on one hot row until each commits; the slot stays locked until
// the transaction ends, so spend last. Only when every slot with uses left
// is held does it wait for one, and then re-checks it. The token row itself
// is only read, never locked. SQLite's single writer needs none of this.
func (t *Tx) ConsumeJoinTokenUse(ctx context.Context, id string) (bool, error) {
	const pick = `SELECT s.token_id, s.slot FROM join_token_slots s JOIN join_tokens j ON j.id = s.token_id
		WHERE s.token_id = ? AND s.uses_left > 0 AND j.revoked_ms IS NULL AND j.expires_ms > compute_now()`
	spend := func(lock string) (bool, error) {
		res, err := t.exec(ctx, "UPDATE join_token_slots SET uses_left = uses_left - 1 WHERE (token_id, slot) IN ("+pick+lock+") AND uses_left > 0", id)
		if err != nil {
			return false, fmt.Errorf("consume join token: %w", err)
		}
		n, err := res.RowsAffected()
		return n == 1, err
	}
	if t.db.dialect != Postgres {
		return spend(" LIMIT 1")
	}
	for attempt := 0; ; attempt++ {
		if ok, err := spend(" ORDER BY random() LIMIT 1 FOR UPDATE OF s SKIP LOCKED"); ok || err != nil {
			return ok, err
		}
		// Every slot with uses left is held (or none has any): wait for
		// one, then try again; the wait re-checks the row it gets.
		if ok, err := spend(" ORDER BY s.slot LIMIT 1 FOR UPDATE OF s"); ok || err != nil {
			return ok, err
		}
		var left int
		if err := t.queryRow(ctx, "SELECT COALESCE(SUM(s.uses_left), 0) FROM join_token_slots s JOIN join_tokens j ON j.id = s.token_id WHERE s.token_id = ? AND j.revoked_ms IS NULL AND j.expires_ms > compute_now()", id).Scan(&left); err != nil {
			return false, fmt.Errorf("read join token uses: %w", err)
		}
		if left == 0 {
			return false, nil
		}
		// Each round, another join took a use; a token this busy for this
		// long is answered as busy rather than waited on forever.
		if attempt == 100 {
			return false, errs.New(errs.Unavailable, "the join token is busy; retry")
		}
	}
}

// ListJoinTokens lists a pool's tokens in id order after `after`; live only
// unless includeInactive.
func (t *Tx) ListJoinTokens(ctx context.Context, poolID string, includeInactive bool, after string, limit int) ([]JoinToken, error) {
	q := "SELECT " + tokenCols + " FROM join_tokens WHERE pool_id = ? AND id > ?"
	if !includeInactive {
		q += " AND revoked_ms IS NULL AND expires_ms > compute_now() AND " + usesLeft + " > 0"
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
