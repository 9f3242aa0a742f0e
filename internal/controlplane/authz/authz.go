// Package authz owns principals, API keys and authorization decisions. Every
// API call is decided as an action on a resource (compute:join-tokens:create
// on compute-pool/{poolId}) for the tenant the request names. A principal
// that may not act for that tenant, or a resource another tenant owns,
// answers NOT_FOUND, never ACCESS_DENIED, so nothing leaks that it exists.
package authz

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// KeyScheme is the bearer scheme of API keys: bck_key_….<secret>.
const KeyScheme = "bck"

// Actions decided by the API.
const (
	TenantsCreate       = "compute:tenants:create"
	TenantsRead         = "compute:tenants:read"
	SitesCreate         = "compute:sites:create"
	SitesRead           = "compute:sites:read"
	PoolsCreate         = "compute:pools:create"
	PoolsRead           = "compute:pools:read"
	PoolsUpdate         = "compute:pools:update"
	APIKeysCreate       = "compute:api-keys:create"
	APIKeysRead         = "compute:api-keys:read"
	APIKeysRevoke       = "compute:api-keys:revoke"
	JoinTokensCreate    = "compute:join-tokens:create"
	JoinTokensRead      = "compute:join-tokens:read"
	JoinTokensRevoke    = "compute:join-tokens:revoke"
	NodesCreate         = "compute:nodes:create"
	NodesRead           = "compute:nodes:read"
	NodesUpdate         = "compute:nodes:update"
	CommandsCreate      = "compute:commands:create"
	CommandsRead        = "compute:commands:read"
	EventsRead          = "compute:events:read"
	AuditRead           = "compute:audit:read"
	JoinRequestsRead    = "compute:join-requests:read"
	JoinRequestsApprove = "compute:join-requests:approve"
	JoinRequestsReject  = "compute:join-requests:reject"
)

// Resource names.
func TenantResource(id string) string { return "compute-tenant/" + id }

// SiteResource names a site.
func SiteResource(id string) string { return "compute-site/" + id }

// PoolResource names a pool.
func PoolResource(id string) string { return "compute-pool/" + id }

// Grant allows actions matching Action on resources matching Resource. A
// pattern is exact, "*", or a prefix ending in "*".
type Grant struct {
	Action   string `json:"action"`
	Resource string `json:"resource"`
}

// Admin grants everything in the tenant.
var Admin = []Grant{{Action: "*", Resource: "*"}}

func match(pattern, s string) bool {
	if p, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(s, p)
	}
	return pattern == s
}

// ValidateGrants checks grant patterns.
func ValidateGrants(gs []Grant) error {
	if len(gs) > 100 {
		return errs.Invalid("grants", "at most 100 grants")
	}
	for i, g := range gs {
		for name, v := range map[string]string{"action": g.Action, "resource": g.Resource} {
			if v == "" || len(v) > 200 || strings.ContainsAny(v, " \t\r\n") || strings.Count(v, "*") > 1 || (strings.Contains(v, "*") && !strings.HasSuffix(v, "*")) {
				return errs.Invalid(fmt.Sprintf("grants[%d].%s", i, name), "want an exact name, * or a prefix ending in *")
			}
		}
	}
	return nil
}

// Principal is who a request speaks for.
type Principal struct {
	ID       string
	TenantID string
	Name     string
	KeyID    string
	Grants   []Grant
	// Root is set for principals of the deployment's root tenant: platform
	// operators, who may act for any tenant.
	Root bool
}

// Allowed reports whether p's grants allow action on resource.
func (p Principal) Allowed(action, resource string) bool {
	for _, g := range p.Grants {
		if match(g.Action, action) && match(g.Resource, resource) {
			return true
		}
	}
	return false
}

// ActFor checks that p may act for tenantID; any other answer is NOT_FOUND.
func (p Principal) ActFor(tenantID string) error {
	if tenantID == "" {
		return errs.Invalid("tenantId", "required")
	}
	if p.TenantID == tenantID || p.Root {
		return nil
	}
	return errs.New(errs.NotFound, "tenant %s not found", tenantID)
}

// Require checks that p may act for tenantID and holds action on resource.
func (p Principal) Require(tenantID, action, resource string) error {
	if err := p.ActFor(tenantID); err != nil {
		return err
	}
	if !p.Allowed(action, resource) {
		if p.TenantID != tenantID {
			// A platform principal acting for another tenant without the
			// grant learns nothing of that tenant's resources: the answer
			// is the one a missing resource gets (R1.2).
			return notFoundResource(tenantID, resource)
		}
		return errs.New(errs.AccessDenied, "%s is not allowed on %s", action, resource)
	}
	return nil
}

// notFoundResource words NOT_FOUND for resource as tenancy does for a
// missing one ("pool pool_… not found"); a pattern names the tenant.
func notFoundResource(tenantID, resource string) error {
	kind, id, ok := strings.Cut(strings.TrimPrefix(resource, "compute-"), "/")
	if !ok || id == "" || strings.Contains(id, "*") {
		return errs.New(errs.NotFound, "tenant %s not found", tenantID)
	}
	return errs.New(errs.NotFound, "%s %s not found", kind, id)
}

type ctxKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, ctxKey{}, p)
}

// From returns the principal in ctx.
func From(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(ctxKey{}).(Principal)
	return p, ok
}

// Authenticate resolves a bearer API key. Every failure is the same
// UNAUTHENTICATED, whatever was wrong.
func Authenticate(ctx context.Context, db *store.DB, bearer string) (Principal, error) {
	return authenticate(ctx, db, bearer, secret.Matches)
}

// unknownKeySum is what a secret is verified against when its key id is
// unknown (see authenticate): the hash of no secret Mint can return.
var unknownKeySum = secret.Hash("")

// authenticate is Authenticate with the secret check as a parameter (tests
// count it). SECURITY: an unknown key id costs the same verification as a
// known one with a wrong secret (against unknownKeySum), and both fail
// before anything else is read, so the answer's timing does not tell a
// caller which key ids exist.
func authenticate(ctx context.Context, db *store.DB, bearer string, verify func(plain string, sum []byte) bool) (Principal, error) {
	unauth := errs.New(errs.Unauthenticated, "a valid API key is required (Authorization: Bearer bck_…)")
	id, plain, ok := secret.Parse(KeyScheme, bearer)
	if !ok || !ids.Valid(ids.APIKey, id) {
		return Principal{}, unauth
	}
	var p Principal
	err := db.ReadTx(ctx, func(tx *store.Tx) error {
		a, err := tx.GetAPIKeyAuth(ctx, id)
		if errors.Is(err, store.ErrNotFound) {
			verify(plain, unknownKeySum)
			return err
		}
		if err != nil {
			return err
		}
		if !verify(plain, a.Key.SecretSHA256) || !a.Live {
			return store.ErrNotFound
		}
		root, err := tx.RootTenantID(ctx)
		if err != nil {
			return err
		}
		p = Principal{ID: a.Principal.ID, TenantID: a.Principal.TenantID, Name: a.Principal.Name, KeyID: a.Key.ID, Root: root != "" && root == a.Principal.TenantID}
		return json.Unmarshal(a.Principal.Grants, &p.Grants)
	})
	if errors.Is(err, store.ErrNotFound) {
		return Principal{}, unauth
	}
	if err != nil {
		return Principal{}, fmt.Errorf("authenticate: %w", err)
	}
	return p, nil
}

// NewKey mints an API key for a new principal named name in tenantID, inside
// tx, and returns the record and the bearer form (shown once).
func NewKey(ctx context.Context, tx *store.Tx, tenantID, name string, grants []Grant, ttl time.Duration, now time.Time) (store.APIKeyRow, string, error) {
	gj, err := json.Marshal(grants)
	if err != nil {
		return store.APIKeyRow{}, "", err
	}
	pr, err := tx.InsertPrincipal(ctx, store.Principal{ID: ids.New(ids.Principal, now), TenantID: tenantID, Name: name, Grants: gj})
	if err != nil {
		if store.IsUniqueViolation(err) {
			return store.APIKeyRow{}, "", errs.New(errs.AlreadyExists, "an API key named %q exists in this tenant", name)
		}
		return store.APIKeyRow{}, "", err
	}
	plain, sum := secret.Mint()
	k := store.APIKey{ID: ids.New(ids.APIKey, now), PrincipalID: pr.ID, TenantID: tenantID, SecretSHA256: sum}
	if ttl > 0 {
		exp := now.Add(ttl)
		k.ExpiresAt = &exp
	}
	k, err = tx.InsertAPIKey(ctx, k)
	if err != nil {
		return store.APIKeyRow{}, "", err
	}
	return store.APIKeyRow{APIKey: k, Name: name, Grants: gj}, secret.Format(KeyScheme, k.ID, plain), nil
}

// Service manages API keys through the API.
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

// MaxIdempotencyKey bounds an idempotency key.
const MaxIdempotencyKey = 128

// ValidIdempotencyKey checks an idempotency key of a create call: empty
// (none), or up to MaxIdempotencyKey printable characters without spaces.
func ValidIdempotencyKey(field, key string) error {
	if len(key) > MaxIdempotencyKey {
		return errs.Invalid(field, "at most %d characters", MaxIdempotencyKey)
	}
	for _, c := range key {
		if !unicode.IsPrint(c) || c == ' ' {
			return errs.Invalid(field, "printable characters without spaces only")
		}
	}
	return nil
}

// ValidName checks names of tenants, sites, pools and keys.
func ValidName(field, s string) error {
	if s == "" || len(s) > 63 {
		return errs.Invalid(field, "1 to 63 characters required")
	}
	for i, r := range s {
		ok := r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || (i > 0 && (r == '-' || r == '.' || r == '_'))
		if !ok {
			return errs.Invalid(field, "use lower-case letters, digits, '-', '.' and '_', starting with a letter or digit")
		}
	}
	return nil
}

// CreateKey mints a key in tenantID for p.
func (s *Service) CreateKey(ctx context.Context, p Principal, tenantID, name string, grants []Grant, ttl time.Duration) (store.APIKeyRow, string, error) {
	if err := p.Require(tenantID, APIKeysCreate, TenantResource(tenantID)); err != nil {
		return store.APIKeyRow{}, "", err
	}
	if err := ValidName("name", name); err != nil {
		return store.APIKeyRow{}, "", err
	}
	if len(grants) == 0 {
		return store.APIKeyRow{}, "", errs.Invalid("grants", "at least one grant is required")
	}
	if err := ValidateGrants(grants); err != nil {
		return store.APIKeyRow{}, "", err
	}
	if ttl < 0 || ttl > 10*365*24*time.Hour {
		return store.APIKeyRow{}, "", errs.Invalid("ttlSeconds", "0 (no expiry) up to ten years")
	}
	// A key cannot grant what its creator does not hold.
	for i, g := range grants {
		if !p.coversGrant(g) {
			return store.APIKeyRow{}, "", errs.New(errs.AccessDenied, "grants[%d]: you cannot grant %s on %s", i, g.Action, g.Resource)
		}
	}
	var row store.APIKeyRow
	var bearer string
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.GetTenant(ctx, tenantID); err != nil {
			if errors.Is(err, store.ErrNotFound) {
				return errs.New(errs.NotFound, "tenant %s not found", tenantID)
			}
			return err
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		row, bearer, err = NewKey(ctx, tx, tenantID, name, grants, ttl, now)
		if err != nil {
			return err
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "security.api-key.created", Subject: row.ID, Data: map[string]any{"apiKeyId": row.ID, "name": name, "by": p.ID}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "api-key.created", Resource: "compute-api-key/" + row.ID, Data: map[string]any{"name": name, "grants": grants}})
	})
	return row, bearer, err
}

// coversGrant reports whether p's own grants include every action and
// resource g could match.
func (p Principal) coversGrant(g Grant) bool {
	for _, own := range p.Grants {
		if covers(own.Action, g.Action) && covers(own.Resource, g.Resource) {
			return true
		}
	}
	return false
}

func covers(own, want string) bool {
	if o, ok := strings.CutSuffix(own, "*"); ok {
		return strings.HasPrefix(strings.TrimSuffix(want, "*"), o)
	}
	return own == want
}

// ListKeys lists a tenant's keys.
func (s *Service) ListKeys(ctx context.Context, p Principal, tenantID, after string, limit int) ([]store.APIKeyRow, error) {
	if err := p.Require(tenantID, APIKeysRead, TenantResource(tenantID)); err != nil {
		return nil, err
	}
	var out []store.APIKeyRow
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		out, err = tx.ListAPIKeys(ctx, tenantID, after, limit)
		return err
	})
	return out, err
}

// RevokeKey revokes a key of the tenant; revoking twice is not an error.
func (s *Service) RevokeKey(ctx context.Context, p Principal, tenantID, keyID string) error {
	if err := p.Require(tenantID, APIKeysRevoke, TenantResource(tenantID)); err != nil {
		return err
	}
	return s.db.WithTx(ctx, func(tx *store.Tx) error {
		ok, err := tx.RevokeAPIKey(ctx, tenantID, keyID)
		if err != nil {
			return err
		}
		if !ok {
			return errs.New(errs.NotFound, "API key %s not found", keyID)
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "security.api-key.revoked", Subject: keyID, Data: map[string]any{"apiKeyId": keyID, "by": p.ID}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "api-key.revoked", Resource: "compute-api-key/" + keyID})
	})
}
