package jointoken_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	tokens "github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// fixture is acme's daemon pool and its token service.
type fixture struct {
	db    *store.DB
	svc   *tokens.Service
	admin authz.Principal
	acme  string
	pool  store.Pool
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	ctx := context.Background()
	ten := tenancy.New(tenancy.Config{DB: db})
	root, _, err := ten.Bootstrap(ctx, "root")
	must(t, err)
	ops := authz.Principal{ID: "prn_ops", TenantID: root.ID, Root: true, Grants: authz.Admin}
	tn, err := ten.CreateTenant(ctx, ops, "acme")
	must(t, err)
	f := &fixture{db: db, svc: tokens.New(tokens.Config{DB: db}), acme: tn.ID,
		admin: authz.Principal{ID: "prn_acme", TenantID: tn.ID, Grants: authz.Admin}}
	site, err := ten.CreateSite(ctx, f.admin, tn.ID, "lab", "")
	must(t, err)
	f.pool, err = ten.CreatePool(ctx, f.admin, tn.ID, site.ID, "gpu", "bcd", tenancy.Policy{})
	must(t, err)
	return f
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// node mints a node token of r.
func (f *fixture) node(t *testing.T, r tokens.CreateRequest) tokens.Created {
	t.Helper()
	r.TenantID, r.PoolID = f.acme, f.pool.ID
	if r.TTL == 0 {
		r.TTL = time.Hour
	}
	c, err := f.svc.Create(context.Background(), f.admin, r)
	must(t, err)
	return c
}

// ramdisk mints a ramdisk token, as a site's boot module does.
func (f *fixture) ramdisk(t *testing.T) string {
	t.Helper()
	var bearer string
	_, _, err := f.svc.MintInternal(context.Background(), sinkFunc(func(_ string, s []byte) (string, error) { bearer = string(s); return "ref", nil }),
		tokens.InternalRequest{Module: "boot", TenantID: f.acme, PoolID: f.pool.ID, Role: tokens.RoleRamdisk, TTL: time.Hour, MaxUses: 5, SecretName: "rd"})
	must(t, err)
	return bearer
}

type sinkFunc func(string, []byte) (string, error)

func (s sinkFunc) Put(name string, b []byte) (string, error) { return s(name, b) }

// admit runs the attestor in a transaction; spend, when set, also runs the
// admission's Spend there, as JoinService does last.
func (f *fixture) admit(t *testing.T, in *attest.Input, spend bool) (*attest.Admission, error) {
	t.Helper()
	ctx := context.Background()
	var adm *attest.Admission
	err := f.db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		if adm, err = jointoken.New().Admit(ctx, tx, in); err != nil || !spend {
			return err
		}
		return adm.Spend(ctx, tx)
	})
	return adm, err
}

// spend runs adm's Spend in a transaction of its own.
func (f *fixture) spend(adm *attest.Admission) error {
	ctx := context.Background()
	return f.db.WithTx(ctx, func(tx *store.Tx) error { return adm.Spend(ctx, tx) })
}

// wantRefusal fails unless err is a refusal for reason, routed to tenant.
func wantRefusal(t *testing.T, err error, reason, tenant string) {
	t.Helper()
	var r *attest.Refusal
	if !errors.As(err, &r) {
		t.Fatalf("want refusal %s, got %v", reason, err)
	}
	if r.Reason != reason || r.TenantID != tenant {
		t.Fatalf("refusal %s to tenant %q, want %s to %q", r.Reason, r.TenantID, reason, tenant)
	}
}

// R4.4, R4.7: each refusal of a presented token, in order: shape, id,
// secret (to the root tenant: nothing is proven yet), then state and role
// (to the token's tenant). R2.7: a token presented for another role.
func TestAdmitRefusals(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		live := f.node(t, tokens.CreateRequest{})
		_, plain, _ := tokens.Parse(live.Bearer)
		other, _ := secret.Mint()
		usedUp := f.node(t, tokens.CreateRequest{})
		_, err := f.admit(t, &attest.Input{Role: "node", Token: usedUp.Bearer}, true)
		must(t, err)
		revoked := f.node(t, tokens.CreateRequest{})
		_, err = f.svc.Revoke(ctx, f.admin, f.acme, f.pool.ID, revoked.Token.ID)
		must(t, err)
		revokedUsedUp := f.node(t, tokens.CreateRequest{})
		_, err = f.admit(t, &attest.Input{Role: "node", Token: revokedUsedUp.Bearer}, true)
		must(t, err)
		_, err = f.svc.Revoke(ctx, f.admin, f.acme, f.pool.ID, revokedUsedUp.Token.ID)
		must(t, err)
		expiring := f.node(t, tokens.CreateRequest{TTL: time.Minute})
		expiringUsedUp := f.node(t, tokens.CreateRequest{TTL: time.Minute})
		_, err = f.admit(t, &attest.Input{Role: "node", Token: expiringUsedUp.Bearer}, true)
		must(t, err)
		ramdisk := f.ramdisk(t)
		must(t, db.SetClockOffset(ctx, 2*time.Minute)) // expiring ones expire at the DB clock
		for _, tc := range []struct {
			name, role, token, reason string
			tokenTenant               bool
		}{
			{"no token", "node", "", "token-missing", false},
			{"malformed", "node", "bcjt_nonsense", "token-malformed", false},
			{"api key", "node", "bck_" + ids.New(ids.APIKey, time.Now()) + "." + plain, "token-malformed", false},
			{"unknown id", "node", secret.Format(tokens.Scheme, ids.New(ids.JoinToken, time.Now()), plain), "token-unknown", false},
			{"wrong secret", "node", secret.Format(tokens.Scheme, live.Token.ID, other), "token-secret", false},
			{"wrong secret of a revoked token", "node", secret.Format(tokens.Scheme, revoked.Token.ID, other), "token-secret", false},
			{"revoked", "node", revoked.Bearer, "token-revoked", true},
			{"revoked beats used up", "node", revokedUsedUp.Bearer, "token-revoked", true},
			{"used up", "node", usedUp.Bearer, "token-used-up", true},
			{"used up beats expired", "node", expiringUsedUp.Bearer, "token-used-up", true},
			{"expired", "node", expiring.Bearer, "token-expired", true},
			{"node token as ramdisk", "ramdisk", live.Bearer, "token-role", true},
			{"ramdisk token as node", "node", ramdisk, "token-role", true},
			{"ramdisk token as site", "site", ramdisk, "token-role", true},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := f.admit(t, &attest.Input{Role: tc.role, Token: tc.token}, false)
				tenant := ""
				if tc.tokenTenant {
					tenant = f.acme
				}
				wantRefusal(t, err, tc.reason, tenant)
			})
		}
	})
}

// R15.2: the role and the pool come from the token; R5 (the expect
// binding), reclaim and hosted pass through to JoinService; Admit spends
// nothing, Spend takes one use (R4.4).
func TestAdmission(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		f := newFixture(t, db)
		c := f.node(t, tokens.CreateRequest{MaxUses: 2, AllowReclaim: true, Hosted: tokens.HostedKubernetes,
			Expect: hwid.Expect{Serial: "SN-42", MAC: "00:1b:21:3a:4f:01"}})
		adm, err := f.admit(t, &attest.Input{Role: "node", Token: c.Bearer}, false)
		must(t, err)
		want := attest.Admission{TenantID: f.acme, PoolID: f.pool.ID, SiteID: f.pool.SiteID, Role: "node",
			Expect: hwid.Expect{Serial: "SN-42", MAC: "00:1b:21:3a:4f:01"}, AllowReclaim: true, Hosted: "kubernetes",
			JoinTokenID: c.Token.ID, NodeKey: "unattested"}
		got := *adm
		got.Spend = nil
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("admission = %+v\nwant        %+v", got, want)
		}
		if left := f.usesLeft(t, c.Token.ID); left != 2 {
			t.Fatalf("Admit spent: %d uses left, want 2", left)
		}
		must(t, f.spend(adm))
		if left := f.usesLeft(t, c.Token.ID); left != 1 {
			t.Fatalf("after Spend: %d uses left, want 1", left)
		}
		// The bearer may carry surrounding space (a token file's newline).
		if _, err := f.admit(t, &attest.Input{Role: "node", Token: " " + c.Bearer + "\n"}, true); err != nil {
			t.Fatal(err)
		}
		_, err = f.admit(t, &attest.Input{Role: "node", Token: c.Bearer}, false)
		wantRefusal(t, err, "token-used-up", f.acme)
	})
}

func (f *fixture) usesLeft(t *testing.T, id string) int {
	t.Helper()
	var tok store.JoinToken
	must(t, f.db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		tok, err = tx.GetJoinToken(context.Background(), id)
		return err
	}))
	return tok.UsesLeft
}

// R4.4: the spend re-checks the token as it takes the use, so a token that
// ran out, was revoked or expired after Admit read it refuses with why.
func TestSpendRechecks(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		for _, tc := range []struct {
			name   string
			change func(t *testing.T, c tokens.Created)
			reason string
		}{
			{"used up meanwhile", func(t *testing.T, c tokens.Created) {
				_, err := f.admit(t, &attest.Input{Role: "node", Token: c.Bearer}, true)
				must(t, err)
			}, "token-used-up"},
			{"revoked meanwhile", func(t *testing.T, c tokens.Created) {
				_, err := f.svc.Revoke(ctx, f.admin, f.acme, f.pool.ID, c.Token.ID)
				must(t, err)
			}, "token-revoked"},
			{"expired meanwhile", func(t *testing.T, c tokens.Created) {
				must(t, db.SetClockOffset(ctx, 2*time.Minute))
			}, "token-expired"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				must(t, db.SetClockOffset(ctx, 0))
				c := f.node(t, tokens.CreateRequest{TTL: time.Minute})
				adm, err := f.admit(t, &attest.Input{Role: "node", Token: c.Bearer}, false)
				must(t, err)
				tc.change(t, c)
				err = f.spend(adm)
				wantRefusal(t, err, tc.reason, f.acme)
				if strings.Contains(err.Error(), "busy") {
					t.Fatalf("spend answered %v", err)
				}
			})
		}
	})
}
