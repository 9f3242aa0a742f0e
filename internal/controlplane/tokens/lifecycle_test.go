package tokens_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// create mints a token in acme's gpu pool.
func (f *fixture) create(t *testing.T, ttl time.Duration, uses int) tokens.Created {
	t.Helper()
	c, err := f.svc.Create(context.Background(), f.admin, tokens.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID, TTL: ttl, MaxUses: uses})
	errstest.Must(t, err)
	return c
}

// spend takes one use as a join's admission does.
func (f *fixture) spend(t *testing.T, id string) bool {
	t.Helper()
	var ok bool
	errstest.Must(t, f.db.WithTx(context.Background(), func(tx *store.Tx) error {
		var err error
		ok, err = tx.ConsumeJoinTokenUse(context.Background(), id)
		return err
	}))
	return ok
}

// R2.5, R2.6: a token's uses run out, it expires at the database clock, it
// is revoked at once; the list shows live tokens, or every one with
// includeInactive, in its state, never with a secret.
func TestLifecycleAndList(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		live := f.create(t, time.Hour, 3)
		usedUp := f.create(t, time.Hour, 2)
		expiring := f.create(t, time.Minute, 1)
		revoked := f.create(t, time.Hour, 1)
		for i := 0; i < 2; i++ {
			if !f.spend(t, usedUp.Token.ID) {
				t.Fatalf("use %d of 2 refused", i+1)
			}
		}
		if f.spend(t, usedUp.Token.ID) {
			t.Fatal("a third use of a two-use token")
		}
		if !f.spend(t, live.Token.ID) {
			t.Fatal("a use of a live token refused")
		}
		_, err := f.svc.Revoke(ctx, f.admin, f.acme, f.gpu.ID, revoked.Token.ID)
		errstest.Must(t, err)
		// A revoked or expired token with uses left answers false at once
		// (on PostgreSQL it once spun until "the join token is busy").
		if f.spend(t, revoked.Token.ID) {
			t.Fatal("a use of a revoked token")
		}
		errstest.Must(t, db.SetClockOffset(ctx, 2*time.Minute))
		if f.spend(t, expiring.Token.ID) {
			t.Fatal("a use of a token expired at the database clock")
		}

		want := map[string]string{live.Token.ID: tokens.StateLive, usedUp.Token.ID: tokens.StateUsedUp,
			expiring.Token.ID: tokens.StateExpired, revoked.Token.ID: tokens.StateRevoked}
		all, err := f.svc.List(ctx, f.admin, f.acme, f.gpu.ID, true, "", 100)
		errstest.Must(t, err)
		if len(all) != len(want) {
			t.Fatalf("includeInactive lists %d tokens, want %d", len(all), len(want))
		}
		for _, tok := range all {
			if got := tokens.State(tok); got != want[tok.ID] {
				t.Errorf("token %s is %s, want %s", tok.ID, got, want[tok.ID])
			}
		}
		if tok := all[0]; tok.ID == live.Token.ID && tok.UsesLeft != 2 {
			t.Errorf("live token has %d uses left, want 2", tok.UsesLeft)
		}
		liveOnly, err := f.svc.List(ctx, f.admin, f.acme, f.gpu.ID, false, "", 100)
		errstest.Must(t, err)
		if len(liveOnly) != 1 || liveOnly[0].ID != live.Token.ID || liveOnly[0].UsesLeft != 2 {
			t.Fatalf("live list = %+v, want the live token with 2 uses", liveOnly)
		}
		_, err = f.svc.List(ctx, f.globAdm, f.globex, f.gpu.ID, true, "", 100)
		errstest.Want(t, err, errs.NotFound, "pool "+f.gpu.ID+" not found")
	})
}

// R2.6, R2.4: revoking ends a token; again is not an error and publishes
// nothing more; a token of another pool, or a bearer token instead of an
// id, is refused.
func TestRevoke(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		c := f.create(t, time.Hour, 1)
		for i := 0; i < 2; i++ {
			tok, err := f.svc.Revoke(ctx, f.admin, f.acme, f.gpu.ID, c.Token.ID)
			errstest.Must(t, err)
			if tok.RevokedAt == nil || tok.Live {
				t.Fatalf("revoke %d: %+v", i, tok)
			}
		}
		if n := f.events(t, f.acme, "security.join-token.revoked"); n != 1 {
			t.Fatalf("%d revoked events, want 1", n)
		}
		_, err := f.svc.Revoke(ctx, f.admin, f.acme, f.cpu.ID, c.Token.ID)
		errstest.Want(t, err, errs.NotFound, "join token "+c.Token.ID+" not found in pool "+f.cpu.ID)
		_, err = f.svc.Revoke(ctx, f.admin, f.acme, f.gpu.ID, c.Bearer)
		errstest.Want(t, err, errs.InvalidArgument, "tokenId: not a token id: want jt_ and 26 characters, as join-tokens list shows (a token's secret is never accepted here, nor echoed)")
		_, err = f.svc.Revoke(ctx, f.globAdm, f.globex, f.gpu.ID, c.Token.ID)
		errstest.Want(t, err, errs.NotFound, "pool "+f.gpu.ID+" not found")
	})
}

// sink is a SecretSink that remembers what it was given or fails.
type sink struct {
	fail error
	got  map[string]string
}

func (s *sink) Put(name string, secret []byte) (string, error) {
	if s.fail != nil {
		return "", s.fail
	}
	if s.got == nil {
		s.got = map[string]string{}
	}
	s.got[name] = string(secret)
	return "ref:" + name, nil
}

// R2.7: modules mint site and ramdisk tokens; the bearer token goes only to
// the sink, and a sink that fails leaves no token behind.
func TestMintInternal(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		ok := tokens.InternalRequest{Module: "boot", TenantID: f.acme, PoolID: f.gpu.ID, Role: tokens.RoleRamdisk,
			TTL: time.Hour, MaxUses: 10, SecretName: "ramdisk.token"}
		with := func(mod func(*tokens.InternalRequest)) tokens.InternalRequest { r := ok; mod(&r); return r }
		for _, tc := range []struct {
			name string
			r    tokens.InternalRequest
			code errs.Code
		}{
			{"node role", with(func(r *tokens.InternalRequest) { r.Role = tokens.RoleNode }), errs.InvalidArgument},
			{"no module", with(func(r *tokens.InternalRequest) { r.Module = "" }), errs.InvalidArgument},
			{"ttl", with(func(r *tokens.InternalRequest) { r.TTL = 25 * time.Hour }), errs.InvalidArgument},
			{"no uses", with(func(r *tokens.InternalRequest) { r.MaxUses = 0 }), errs.InvalidArgument},
			{"no daemon", with(func(r *tokens.InternalRequest) { r.PoolID = f.ipmi.ID }), errs.InvalidState},
			{"another tenant's pool", with(func(r *tokens.InternalRequest) { r.PoolID = f.glob.ID }), errs.NotFound},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, _, err := f.svc.MintInternal(ctx, &sink{}, tc.r)
				errstest.Want(t, err, tc.code, "")
			})
		}

		s := &sink{}
		for _, role := range []string{tokens.RoleSite, tokens.RoleRamdisk} {
			tok, ref, err := f.svc.MintInternal(ctx, s, with(func(r *tokens.InternalRequest) { r.Role, r.SecretName = role, role }))
			errstest.Must(t, err)
			id, _, parsed := tokens.Parse(s.got[role])
			if ref != "ref:"+role || !parsed || id != tok.ID || tok.Role != role || tok.CreatedBy != "module:boot" || tok.UsesLeft != 10 {
				t.Fatalf("%s: token %+v, ref %q, sink got %q", role, tok, ref, s.got[role])
			}
		}
		_, _, err := f.svc.MintInternal(ctx, &sink{fail: errors.New("disk full")}, ok)
		if err == nil || !strings.Contains(err.Error(), "disk full") {
			t.Fatalf("failing sink: %v", err)
		}
		all, err := f.svc.List(ctx, f.admin, f.acme, f.gpu.ID, true, "", 100)
		if err != nil || len(all) != 2 {
			t.Fatalf("%d tokens after a failed sink, %v; want the 2 minted", len(all), err)
		}
	})
}

// R2.7: FileSink keeps each secret in a new owner-only file and never
// overwrites one.
func TestFileSink(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "secrets")
	s := tokens.FileSink{Dir: dir}
	ref, err := s.Put("ramdisk.token", []byte("bcjt_x.y"))
	errstest.Must(t, err)
	path := filepath.Join(dir, "ramdisk.token")
	if ref != "file:"+path {
		t.Fatalf("ref = %q", ref)
	}
	fi, err := os.Stat(path)
	errstest.Must(t, err)
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", fi.Mode().Perm())
	}
	if b, _ := os.ReadFile(path); string(b) != "bcjt_x.y\n" {
		t.Fatalf("file holds %q", b)
	}
	if _, err := s.Put("ramdisk.token", []byte("other")); err == nil {
		t.Fatal("a second Put overwrote the secret")
	}
	for _, name := range []string{"", "../escape", "a/b"} {
		if _, err := s.Put(name, []byte("x")); err == nil {
			t.Errorf("Put(%q) accepted", name)
		}
	}
}
