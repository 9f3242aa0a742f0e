package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Principal is a principals row: who an API key speaks for. Grants is JSON.
type Principal struct {
	ID        string
	TenantID  string
	Name      string
	Grants    []byte
	CreatedAt time.Time
}

// APIKey is an api_keys row. Only the SHA-256 of the secret is stored.
type APIKey struct {
	ID           string
	PrincipalID  string
	TenantID     string
	SecretSHA256 []byte
	CreatedAt    time.Time
	ExpiresAt    *time.Time
	RevokedAt    *time.Time
}

// InsertPrincipal inserts a principal.
func (t *Tx) InsertPrincipal(ctx context.Context, p Principal) (Principal, error) {
	var created int64
	err := t.queryRow(ctx, "INSERT INTO principals (id, tenant_id, name, grants, created_ms) VALUES (?, ?, ?, ?, compute_now()) RETURNING created_ms",
		p.ID, p.TenantID, p.Name, string(p.Grants)).Scan(&created)
	if err != nil {
		return Principal{}, fmt.Errorf("insert principal: %w", err)
	}
	p.CreatedAt = fromMS(created)
	return p, nil
}

// InsertAPIKey inserts a key.
func (t *Tx) InsertAPIKey(ctx context.Context, k APIKey) (APIKey, error) {
	var exp sql.NullInt64
	if k.ExpiresAt != nil {
		exp = sql.NullInt64{Int64: ms(*k.ExpiresAt), Valid: true}
	}
	var created int64
	err := t.queryRow(ctx, "INSERT INTO api_keys (id, principal_id, tenant_id, secret_sha256, created_ms, expires_ms) VALUES (?, ?, ?, ?, compute_now(), ?) RETURNING created_ms",
		k.ID, k.PrincipalID, k.TenantID, k.SecretSHA256, exp).Scan(&created)
	if err != nil {
		return APIKey{}, fmt.Errorf("insert api key: %w", err)
	}
	k.CreatedAt = fromMS(created)
	return k, nil
}

// APIKeyAuth is what authenticating a key needs: the key, its principal and
// whether it is live at compute_now().
type APIKeyAuth struct {
	Key       APIKey
	Principal Principal
	Live      bool
}

// GetAPIKeyAuth reads a key with its principal.
func (t *Tx) GetAPIKeyAuth(ctx context.Context, id string) (APIKeyAuth, error) {
	var a APIKeyAuth
	var kc, pc int64
	var exp, rev sql.NullInt64
	var grants string
	var live bool
	err := t.queryRow(ctx, `SELECT k.id, k.principal_id, k.tenant_id, k.secret_sha256, k.created_ms, k.expires_ms, k.revoked_ms,
			p.name, p.grants, p.created_ms,
			(k.revoked_ms IS NULL AND (k.expires_ms IS NULL OR k.expires_ms > compute_now()))
		FROM api_keys k JOIN principals p ON p.id = k.principal_id WHERE k.id = ?`, id).
		Scan(&a.Key.ID, &a.Key.PrincipalID, &a.Key.TenantID, &a.Key.SecretSHA256, &kc, &exp, &rev, &a.Principal.Name, &grants, &pc, &live)
	if err != nil {
		return APIKeyAuth{}, notFound(err)
	}
	a.Key.CreatedAt, a.Key.ExpiresAt, a.Key.RevokedAt = fromMS(kc), fromNullMS(exp), fromNullMS(rev)
	a.Principal.ID, a.Principal.TenantID, a.Principal.Grants, a.Principal.CreatedAt = a.Key.PrincipalID, a.Key.TenantID, []byte(grants), fromMS(pc)
	a.Live = live
	return a, nil
}

// APIKeyRow is a key listed with its principal's name and grants.
type APIKeyRow struct {
	APIKey
	Name   string
	Grants []byte
}

// ListAPIKeys lists a tenant's keys.
func (t *Tx) ListAPIKeys(ctx context.Context, tenantID, after string, limit int) ([]APIKeyRow, error) {
	rows, err := t.query(ctx, `SELECT k.id, k.principal_id, k.tenant_id, k.created_ms, k.expires_ms, k.revoked_ms, p.name, p.grants
		FROM api_keys k JOIN principals p ON p.id = k.principal_id
		WHERE k.tenant_id = ? AND k.id > ? ORDER BY k.id LIMIT ?`, tenantID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list api keys: %w", err)
	}
	defer rows.Close()
	var out []APIKeyRow
	for rows.Next() {
		var r APIKeyRow
		var c int64
		var exp, rev sql.NullInt64
		var grants string
		if err := rows.Scan(&r.ID, &r.PrincipalID, &r.TenantID, &c, &exp, &rev, &r.Name, &grants); err != nil {
			return nil, err
		}
		r.CreatedAt, r.ExpiresAt, r.RevokedAt, r.Grants = fromMS(c), fromNullMS(exp), fromNullMS(rev), []byte(grants)
		out = append(out, r)
	}
	return out, rows.Err()
}

// RevokeAPIKey marks a key revoked (keeping the first revocation time). It
// reports whether the key exists in that tenant.
func (t *Tx) RevokeAPIKey(ctx context.Context, tenantID, id string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE api_keys SET revoked_ms = COALESCE(revoked_ms, compute_now()) WHERE id = ? AND tenant_id = ?", id, tenantID)
	if err != nil {
		return false, fmt.Errorf("revoke api key: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}
