package tokens_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// R2.1: the bearer form is bcjt_<jt id>.<secret>; anything else is no token.
func TestParse(t *testing.T) {
	id := ids.New(ids.JoinToken, time.Now())
	plain, _ := secret.Mint()
	for _, tc := range []struct {
		bearer string
		ok     bool
	}{
		{"bcjt_" + id + "." + plain, true},
		{" bcjt_" + id + "." + plain + "\n", true},
		{"bck_" + id + "." + plain, false},
		{"bcjt_" + ids.New(ids.APIKey, time.Now()) + "." + plain, false},
		{"bcjt_" + id + "." + plain[:42], false},
		{"bcjt_" + id, false},
		{"bcjt_" + id + ".", false},
		{"", false},
	} {
		gotID, gotPlain, ok := tokens.Parse(tc.bearer)
		if ok != tc.ok || (ok && (gotID != id || gotPlain != plain)) {
			t.Errorf("Parse(%q) = %q, %q, %v; want ok=%v", tc.bearer, gotID, gotPlain, ok, tc.ok)
		}
	}
}

// R2.5, R4.4: a token's state, in one order of precedence for listing and
// admission: revoked, then used up, then expired.
func TestState(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name                     string
		revoked, expired, noUses bool
		want                     string
	}{
		{"live", false, false, false, tokens.StateLive},
		{"expired", false, true, false, tokens.StateExpired},
		{"used up", false, false, true, tokens.StateUsedUp},
		{"used up beats expired", false, true, true, tokens.StateUsedUp},
		{"revoked beats all", true, true, true, tokens.StateRevoked},
		{"revoked live", true, false, false, tokens.StateRevoked},
	} {
		t.Run(tc.name, func(t *testing.T) {
			row := store.JoinToken{UsesLeft: 1, Live: !tc.revoked && !tc.expired && !tc.noUses}
			if tc.noUses {
				row.UsesLeft = 0
			}
			if tc.revoked {
				row.RevokedAt = &now
			}
			adm := store.AdmissionToken{Revoked: tc.revoked, Expired: tc.expired, HasUses: !tc.noUses}
			if got := tokens.State(row); got != tc.want {
				t.Errorf("State = %q, want %q", got, tc.want)
			}
			if got := tokens.AdmissionState(adm); got != tc.want {
				t.Errorf("AdmissionState = %q, want %q", got, tc.want)
			}
		})
	}
}

// R2.2: what joinTokens.create accepts.
func TestCreateRefusals(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		ok := tokens.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, TTL: time.Hour}
		with := func(mod func(*tokens.CreateRequest)) tokens.CreateRequest { r := ok; mod(&r); return r }
		const ttlMsg = "ttlSeconds: must be whole seconds from 60 (1m) to 86400 (24h)"
		for _, tc := range []struct {
			name string
			p    authz.Principal
			r    tokens.CreateRequest
			code errs.Code
			msg  string
		}{
			{"ttl too short", f.admin, with(func(r *tokens.CreateRequest) { r.TTL = 59 * time.Second }), errs.InvalidArgument, ttlMsg},
			{"ttl too long", f.admin, with(func(r *tokens.CreateRequest) { r.TTL = 24*time.Hour + time.Second }), errs.InvalidArgument, ttlMsg},
			{"ttl not whole seconds", f.admin, with(func(r *tokens.CreateRequest) { r.TTL = time.Minute + time.Millisecond }), errs.InvalidArgument, ttlMsg},
			{"negative uses", f.admin, with(func(r *tokens.CreateRequest) { r.MaxUses = -1 }), errs.InvalidArgument, "maxUses: must be from 1 to 100000"},
			{"too many uses", f.admin, with(func(r *tokens.CreateRequest) { r.MaxUses = tokens.MaxMaxUses + 1 }), errs.InvalidArgument, "maxUses: must be from 1 to 100000"},
			{"hosted", f.admin, with(func(r *tokens.CreateRequest) { r.Hosted = "nomad" }), errs.InvalidArgument, `hosted: must be empty or "kubernetes"`},
			{"idempotency key", f.admin, with(func(r *tokens.CreateRequest) { r.IdempotencyKey = "a b" }), errs.InvalidArgument, ""},
			{"expect", f.admin, with(func(r *tokens.CreateRequest) { r.Expect.ProductUUID = "not-a-uuid" }), errs.InvalidArgument, ""},
			{"pool runs no daemon", f.admin, with(func(r *tokens.CreateRequest) { r.PoolID = f.ipmi.ID }), errs.InvalidState, ""},
			{"another tenant's pool", f.admin, with(func(r *tokens.CreateRequest) { r.PoolID = f.glob.ID }), errs.NotFound, "pool " + f.glob.ID + " not found"},
			{"another tenant", f.globAdm, ok, errs.NotFound, "tenant " + f.acme + " not found"},
			{"not granted on the pool", authz.Principal{TenantID: f.acme, Grants: []authz.Grant{{Action: authz.JoinTokensCreate, Resource: authz.PoolResource(f.cpu.ID)}}},
				ok, errs.AccessDenied, "compute:join-tokens:create is not allowed on compute-pool/" + f.gpu.ID},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := f.svc.Create(ctx, tc.p, tc.r)
				errstest.Want(t, err, tc.code, tc.msg)
			})
		}
		if n := f.events(t, f.acme, "security.join-token.created"); n != 0 {
			t.Fatalf("%d tokens created by refused calls", n)
		}
	})
}

// R2.1, R2.3, R2.4: a token is shown once; only the SHA-256 of its secret
// is stored; it expires ttl after the database clock; one event.
func TestCreate(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		// The database clock, not the caller's, dates the token.
		errstest.Must(t, db.SetClockOffset(ctx, 48*time.Hour))
		c, err := f.svc.Create(ctx, f.admin, tokens.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, TTL: 10 * time.Minute,
			Expect: hwid.Expect{Serial: "SN-1"}, AllowReclaim: true, Hosted: tokens.HostedKubernetes})
		errstest.Must(t, err)
		id, plain, ok := tokens.Parse(c.Bearer)
		if !ok || id != c.Token.ID {
			t.Fatalf("bearer %q does not name token %s", c.Bearer, c.Token.ID)
		}
		stored := f.token(t, id)
		if !bytes.Equal(stored.SecretSHA256, secret.Hash(plain)) || bytes.Contains(stored.SecretSHA256, []byte(plain)) {
			t.Fatal("the stored secret must be its SHA-256 only")
		}
		if stored.Role != tokens.RoleNode || stored.MaxUses != 1 || stored.UsesLeft != 1 || !stored.Live || stored.SiteID != f.gpu.SiteID ||
			!stored.AllowReclaim || stored.Hosted != "kubernetes" || stored.CreatedBy != f.admin.ID {
			t.Fatalf("stored token = %+v", stored)
		}
		if e, _ := tokens.Expect(stored); e.Serial != "SN-1" {
			t.Fatalf("expect = %+v", e)
		}
		if d := stored.ExpiresAt.Sub(stored.CreatedAt); d != 10*time.Minute {
			t.Fatalf("expires %v after creation, want 10m", d)
		}
		if skew := stored.CreatedAt.Sub(time.Now().Add(48 * time.Hour)); skew > time.Minute || skew < -time.Minute {
			t.Fatalf("created at %v: not the database clock", stored.CreatedAt)
		}
		if n := f.events(t, f.acme, "security.join-token.created"); n != 1 {
			t.Fatalf("%d created events, want 1", n)
		}
		// Past the expiry by the database clock, the token is expired.
		errstest.Must(t, db.SetClockOffset(ctx, 48*time.Hour+11*time.Minute))
		if got := tokens.State(f.token(t, id)); got != tokens.StateExpired {
			t.Fatalf("state after expiry = %q", got)
		}
	})
}

// R2.3: a repeated idempotency key answers the first record without its
// secret; another pool, expect, allowReclaim or hosted is a CONFLICT, and
// a key of another pool names nothing of that pool's token.
func TestCreateIdempotency(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		base := tokens.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, TTL: time.Hour, IdempotencyKey: "deploy-1",
			Expect: hwid.Expect{MAC: "00:1b:21:3a:4f:01"}}
		first, err := f.svc.Create(ctx, f.admin, base)
		errstest.Must(t, err)
		with := func(mod func(*tokens.CreateRequest)) tokens.CreateRequest { r := base; mod(&r); return r }
		conflict := func(field string) string {
			return `idempotency key "deploy-1" was used for token ` + first.Token.ID + " with another " + field
		}
		for _, tc := range []struct {
			name string
			r    tokens.CreateRequest
			msg  string
		}{
			{"same request", base, ""},
			{"same, other ttl and uses", with(func(r *tokens.CreateRequest) { r.TTL, r.MaxUses = 2*time.Hour, 5 }), ""},
			{"same expect, other spelling", with(func(r *tokens.CreateRequest) { r.Expect.MAC = "00:1B:21:3A:4F:01" }), ""},
			{"other expect", with(func(r *tokens.CreateRequest) { r.Expect = hwid.Expect{} }), conflict("expect")},
			{"other allowReclaim", with(func(r *tokens.CreateRequest) { r.AllowReclaim = true }), conflict("allowReclaim")},
			{"other hosted", with(func(r *tokens.CreateRequest) { r.Hosted = "kubernetes" }), conflict("hosted")},
			{"other pool", with(func(r *tokens.CreateRequest) { r.PoolID = f.cpu.ID }),
				`idempotency key "deploy-1" is already used in this tenant for another request; choose another key`},
		} {
			t.Run(tc.name, func(t *testing.T) {
				c, err := f.svc.Create(ctx, f.admin, tc.r)
				if tc.msg != "" {
					errstest.Want(t, err, errs.Conflict, tc.msg)
					if strings.Contains(tc.name, "pool") && strings.Contains(err.Error(), first.Token.ID) {
						t.Fatal("a key of another pool must not name its token")
					}
					return
				}
				errstest.Must(t, err)
				if c.Token.ID != first.Token.ID || c.Bearer != "" {
					t.Fatalf("replay = %s (bearer %q), want %s without a bearer", c.Token.ID, c.Bearer, first.Token.ID)
				}
			})
		}
		// Keys are per tenant: globex may use the same one.
		g, err := f.svc.Create(ctx, f.globAdm, tokens.CreateRequest{TenantID: f.globex, PoolID: f.glob.ID, TTL: time.Hour, IdempotencyKey: "deploy-1"})
		if err != nil || g.Bearer == "" {
			t.Fatalf("globex with the same key: %+v, %v", g, err)
		}
		if n := f.events(t, f.acme, "security.join-token.created"); n != 1 {
			t.Fatalf("%d created events, want 1", n)
		}
	})
}
