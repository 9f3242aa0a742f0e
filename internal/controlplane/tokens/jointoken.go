// Package tokens owns join tokens: minting (bcjt_<id>.<secret>, only the
// SHA-256 of the secret stored), idempotent creation, listing without
// secrets, and revocation. Checking a presented token during a join is the
// join-token attestor's work (internal/controlplane/join/attest/jointoken), which reads
// the same rows through the store.
package tokens

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// Scheme is the bearer scheme of join tokens: bcjt_jt_….<secret>.
const Scheme = "bcjt"

// Roles a token can admit. The API mints only node tokens; modules mint
// site and ramdisk tokens internally.
const (
	RoleNode    = "node"
	RoleSite    = "site"
	RoleRamdisk = "ramdisk"
)

// HostedKubernetes marks a token for bcd as a DaemonSet.
const HostedKubernetes = "kubernetes"

// Limits of a token.
const (
	MinTTL     = time.Minute
	MaxTTL     = 24 * time.Hour
	MaxMaxUses = 100000
)

// Token states, as listed.
const (
	StateLive    = "live"
	StateRevoked = "revoked"
	StateExpired = "expired"
	StateUsedUp  = "used-up"
)

// State tells a stored token's state.
func State(t store.JoinToken) string {
	return state(t.RevokedAt != nil, t.UsesLeft > 0, t.Live)
}

// AdmissionState is State of a token as a join's admission reads it
// (store.GetJoinTokenForJoin), in the same order of precedence.
func AdmissionState(t store.AdmissionToken) string {
	return state(t.Revoked, t.HasUses, !t.Revoked && !t.Expired && t.HasUses)
}

// state decides a token's state: revoked first, then used up, then expired.
func state(revoked, hasUses, live bool) string {
	switch {
	case revoked:
		return StateRevoked
	case !hasUses:
		return StateUsedUp
	case !live:
		return StateExpired
	}
	return StateLive
}

// Expect decodes a stored token's binding.
func Expect(t store.JoinToken) (hwid.Expect, error) { return ParseExpect(t.ID, t.Expect) }

// ParseExpect decodes the stored binding of token id.
func ParseExpect(id string, raw []byte) (hwid.Expect, error) {
	var e hwid.Expect
	if len(raw) == 0 {
		return e, nil
	}
	if err := json.Unmarshal(raw, &e); err != nil {
		return e, fmt.Errorf("parse expect of %s: %w", id, err)
	}
	return e, nil
}

// Parse splits a bearer token into its id and secret.
func Parse(bearer string) (id, plain string, ok bool) {
	id, plain, ok = secret.Parse(Scheme, bearer)
	if !ok || !ids.Valid(ids.JoinToken, id) {
		return "", "", false
	}
	return id, plain, true
}

// CreateRequest is joinTokens.create.
type CreateRequest struct {
	TenantID       string
	PoolID         string
	TTL            time.Duration
	MaxUses        int
	Expect         hwid.Expect
	AllowReclaim   bool
	Hosted         string
	IdempotencyKey string
}

// Created is the answer: the record, and the bearer token unless the call
// replayed an idempotency key.
type Created struct {
	Token  store.JoinToken
	Bearer string
}

// Service manages join tokens.
type Service struct {
	db  *store.DB
	hub *events.Hub
}

// Config lists the Service's dependencies.
type Config struct {
	DB  *store.DB
	Hub *events.Hub
}

// New returns a Service.
func New(cfg Config) *Service { return &Service{db: cfg.DB, hub: cfg.Hub} }

func (r *CreateRequest) validate() error {
	if r.TTL < MinTTL || r.TTL > MaxTTL || r.TTL%time.Second != 0 {
		return errs.Invalid("ttlSeconds", "must be whole seconds from 60 (1m) to 86400 (24h)")
	}
	if r.MaxUses == 0 {
		r.MaxUses = 1
	}
	if r.MaxUses < 1 || r.MaxUses > MaxMaxUses {
		return errs.Invalid("maxUses", "must be from 1 to %d", MaxMaxUses)
	}
	if r.Hosted != "" && r.Hosted != HostedKubernetes {
		return errs.Invalid("hosted", "must be empty or %q", HostedKubernetes)
	}
	if err := authz.ValidIdempotencyKey("idempotencyKey", r.IdempotencyKey); err != nil {
		return err
	}
	e, err := hwid.NormalizeExpect(r.Expect)
	if err != nil {
		return err
	}
	r.Expect = e
	return nil
}

// Create mints a token for a pool of the tenant (R2.2, R2.3, R2.4).
func (s *Service) Create(ctx context.Context, p authz.Principal, r CreateRequest) (Created, error) {
	if err := p.ActFor(r.TenantID); err != nil {
		return Created{}, err
	}
	if err := r.validate(); err != nil {
		return Created{}, err
	}
	expectJSON, err := json.Marshal(r.Expect)
	if err != nil {
		return Created{}, err
	}
	var out Created
	create := func() error {
		return s.db.WithTx(ctx, func(tx *store.Tx) error {
			pool, err := tenancy.PoolFor(ctx, tx, p, r.TenantID, r.PoolID, authz.JoinTokensCreate)
			if err != nil {
				return err
			}
			if err := tenancy.RunsDaemon(pool, "join tokens"); err != nil {
				return err
			}
			if r.IdempotencyKey != "" {
				prev, err := tx.GetJoinTokenByKey(ctx, r.TenantID, r.IdempotencyKey)
				if err == nil {
					if err := sameRequest(prev, r, expectJSON); err != nil {
						return err
					}
					out = Created{Token: prev}
					return nil
				}
				if !errors.Is(err, store.ErrNotFound) {
					return err
				}
			}
			now, err := tx.Now(ctx)
			if err != nil {
				return err
			}
			plain, sum := secret.Mint()
			tok, err := tx.InsertJoinToken(ctx, store.JoinToken{
				ID: ids.New(ids.JoinToken, now), TenantID: r.TenantID, PoolID: pool.ID, SiteID: pool.SiteID, Role: RoleNode,
				SecretSHA256: sum, MaxUses: r.MaxUses, Expect: expectJSON, AllowReclaim: r.AllowReclaim, Hosted: r.Hosted,
				IdempotencyKey: r.IdempotencyKey, CreatedBy: p.ID,
			}, r.TTL)
			if err != nil {
				return err
			}
			data := map[string]any{"tokenId": tok.ID, "poolId": pool.ID, "siteId": pool.SiteID, "role": tok.Role, "maxUses": tok.MaxUses,
				"expiresAt": tok.ExpiresAt, "pinned": !r.Expect.Empty(), "allowReclaim": tok.AllowReclaim, "createdBy": p.ID}
			if r.Hosted != "" {
				data["hosted"] = r.Hosted
			}
			if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: r.TenantID, Type: "security.join-token.created", Subject: tok.ID, Data: data}); err != nil {
				return err
			}
			if err := events.Audit(ctx, tx, events.Entry{TenantID: r.TenantID, Actor: p.ID, Action: "join-token.created", Resource: authz.PoolResource(pool.ID), Data: data}); err != nil {
				return err
			}
			out = Created{Token: tok, Bearer: secret.Format(Scheme, tok.ID, plain)}
			return nil
		})
	}
	err = create()
	if store.IsUniqueViolation(err) && r.IdempotencyKey != "" {
		// A concurrent create with the same key won: answer as a replay.
		err = create()
	}
	return out, err
}

// sameRequest checks that a replayed idempotency key asks for the same token.
//
// SECURITY: keys are unique per tenant (R2.3: the same key for another pool
// is a CONFLICT), but the caller is authorized only for the pool it names.
// A key first used in another pool therefore answers CONFLICT without
// naming that token, its pool or what differs: a caller with rights on one
// pool must not learn token ids of a pool it cannot see by guessing keys.
// Only a key used in the same pool names the token.
func sameRequest(prev store.JoinToken, r CreateRequest, expectJSON []byte) error {
	if prev.PoolID != r.PoolID {
		return errs.New(errs.Conflict, "idempotency key %q is already used in this tenant for another request; choose another key", r.IdempotencyKey)
	}
	prevExpect, err := Expect(prev)
	if err != nil {
		return err
	}
	var field string
	switch {
	case prevExpect != r.Expect:
		field = "expect"
	case prev.AllowReclaim != r.AllowReclaim:
		field = "allowReclaim"
	case prev.Hosted != r.Hosted:
		field = "hosted"
	default:
		return nil
	}
	return errs.New(errs.Conflict, "idempotency key %q was used for token %s with another %s", r.IdempotencyKey, prev.ID, field)
}

// List lists a pool's tokens (R2.5). Secrets are never stored, so never shown.
func (s *Service) List(ctx context.Context, p authz.Principal, tenantID, poolID string, includeInactive bool, after string, limit int) ([]store.JoinToken, error) {
	if err := p.ActFor(tenantID); err != nil {
		return nil, err
	}
	var out []store.JoinToken
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		pool, err := tenancy.PoolFor(ctx, tx, p, tenantID, poolID, authz.JoinTokensRead)
		if err != nil {
			return err
		}
		out, err = tx.ListJoinTokens(ctx, pool.ID, includeInactive, after, limit)
		return err
	})
	return out, err
}

// Revoke ends a token at once (R2.6). Revoking twice is not an error; only
// the first publishes security.join-token.revoked.
func (s *Service) Revoke(ctx context.Context, p authz.Principal, tenantID, poolID, tokenID string) (store.JoinToken, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.JoinToken{}, err
	}
	if !ids.Valid(ids.JoinToken, tokenID) {
		return store.JoinToken{}, errs.Invalid("tokenId", "not a token id: want jt_ and 26 characters, as join-tokens list shows (a token's secret is never accepted here, nor echoed)")
	}
	var out store.JoinToken
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		pool, err := tenancy.PoolFor(ctx, tx, p, tenantID, poolID, authz.JoinTokensRevoke)
		if err != nil {
			return err
		}
		tok, err := tx.GetJoinToken(ctx, tokenID)
		if errors.Is(err, store.ErrNotFound) || (err == nil && tok.PoolID != pool.ID) {
			return errs.New(errs.NotFound, "join token %s not found in pool %s", tokenID, pool.ID)
		}
		if err != nil {
			return err
		}
		first, err := tx.RevokeJoinToken(ctx, tokenID)
		if err != nil {
			return err
		}
		if first {
			data := map[string]any{"tokenId": tokenID, "poolId": pool.ID, "usesLeft": tok.UsesLeft, "revokedBy": p.ID}
			if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "security.join-token.revoked", Subject: tokenID, Data: data}); err != nil {
				return err
			}
			if err := events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "join-token.revoked", Resource: authz.PoolResource(pool.ID), Data: data}); err != nil {
				return err
			}
		}
		out, err = tx.GetJoinToken(ctx, tokenID)
		return err
	})
	return out, err
}
