package api_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// mkTokens creates n tokens in parallel and returns their ids.
func mkTokens(t *testing.T, e *apitest.Env, tenant, pool string, n int, ttl int32) []string {
	t.Helper()
	ids := make([]string, n)
	errv := make([]error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			r, err := e.Admin.JoinTokens.CreateJoinToken(context.Background(), rq(&bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool, TtlSeconds: ttl, MaxUses: 1}))
			if errv[i] = err; err == nil {
				ids[i] = r.Msg.Id
			}
		})
	}
	wg.Wait()
	for _, err := range errv {
		mustOK(t, err)
	}
	return ids
}

// R2.5: pages of 100 by default and at most 200, a cursor that walks every
// token exactly once, live tokens only unless includeInactive, never a
// secret.
func TestListJoinTokensPagination(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		ids := mkTokens(t, e, w.root, w.pool.Id, 250, 3600)
		slices.Sort(ids)
		list := func(r *bcv1.ListJoinTokensRequest) *bcv1.ListJoinTokensResponse {
			t.Helper()
			r.TenantId, r.PoolId = w.root, w.pool.Id
			res, err := e.Admin.JoinTokens.ListJoinTokens(ctx, rq(r))
			mustOK(t, err)
			return res.Msg
		}
		t.Run("default page is 100", func(t *testing.T) {
			p := list(&bcv1.ListJoinTokensRequest{})
			if len(p.Items) != 100 || p.NextPageToken == "" {
				t.Fatalf("%d items, next %q", len(p.Items), p.NextPageToken)
			}
		})
		t.Run("page size is at most 200", func(t *testing.T) {
			for _, size := range []int32{200, 201, 500} {
				p := list(&bcv1.ListJoinTokensRequest{PageSize: size})
				if len(p.Items) != 200 || p.NextPageToken == "" {
					t.Fatalf("pageSize %d: %d items, next %q", size, len(p.Items), p.NextPageToken)
				}
			}
		})
		t.Run("bad page arguments", func(t *testing.T) {
			_, err := e.Admin.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id, PageSize: -1}))
			wantErr(t, err, errs.InvalidArgument, "pageSize")
			_, err = e.Admin.JoinTokens.ListJoinTokens(ctx, rq(&bcv1.ListJoinTokensRequest{TenantId: w.root, PoolId: w.pool.Id, PageToken: strings.Repeat("x", 65)}))
			wantErr(t, err, errs.InvalidArgument, "pageToken")
		})
		for _, size := range []int32{0, 37, 100, 200, 500} {
			t.Run("walk", func(t *testing.T) {
				got := listAll(t, e.Admin, w.root, w.pool.Id, false, size)
				var seen []string
				for _, it := range got {
					if it.Token != "" {
						t.Fatalf("list shows the token of %s", it.Id)
					}
					if it.State != "live" || it.PoolId != w.pool.Id || it.Role != "node" {
						t.Fatalf("item = %v", it)
					}
					seen = append(seen, it.Id)
				}
				if !slices.Equal(seen, ids) {
					t.Fatalf("pageSize %d: walked %d ids, want each of %d once in id order", size, len(seen), len(ids))
				}
			})
		}
		// Another pool's list holds none of them.
		if got := listAll(t, e.Admin, w.root, w.pool2.Id, true, 0); len(got) != 0 {
			t.Fatalf("pool2 lists %d tokens", len(got))
		}
	})
}

// R2.5, R2.6: includeInactive adds revoked, expired (at compute_now()) and
// used-up tokens, each with its state.
func TestListJoinTokensInactive(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		live := mkTokens(t, e, w.root, w.pool.Id, 4, 3600)
		short := mkTokens(t, e, w.root, w.pool.Id, 3, 60)
		revoked := mkTokens(t, e, w.root, w.pool.Id, 2, 3600)
		usedUp := mkTokens(t, e, w.root, w.pool.Id, 2, 3600)
		for _, id := range revoked {
			_, err := e.Admin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: id}))
			mustOK(t, err)
		}
		// No machine can join here: spend the single use through the store,
		// as the join-token attestor does.
		for _, id := range usedUp {
			mustOK(t, e.DB.WithTx(ctx, func(tx *store.Tx) error {
				ok, err := tx.ConsumeJoinTokenUse(ctx, id)
				if err == nil && !ok {
					t.Errorf("consume %s: no use left", id)
				}
				return err
			}))
		}
		states := func(inactive bool) map[string]string {
			out := map[string]string{}
			for _, it := range listAll(t, e.Admin, w.root, w.pool.Id, inactive, 5) {
				if it.Token != "" {
					t.Fatalf("list shows the token of %s", it.Id)
				}
				out[it.Id] = it.State
			}
			return out
		}
		want := func(m map[string]string, ids []string, state string) {
			t.Helper()
			for _, id := range ids {
				if m[id] != state {
					t.Fatalf("%s: state %q, want %q", id, m[id], state)
				}
			}
		}
		// Before the clock moves, the short tokens are live.
		m := states(false)
		if len(m) != len(live)+len(short) {
			t.Fatalf("live list has %d tokens, want %d", len(m), len(live)+len(short))
		}
		want(m, live, "live")
		want(m, short, "live")

		mustOK(t, e.DB.SetClockOffset(ctx, 61*time.Second))
		m = states(false)
		if len(m) != len(live) {
			t.Fatalf("after expiry the live list has %d tokens, want %d: %v", len(m), len(live), m)
		}
		want(m, live, "live")

		m = states(true)
		if len(m) != len(live)+len(short)+len(revoked)+len(usedUp) {
			t.Fatalf("inactive list has %d tokens: %v", len(m), m)
		}
		want(m, live, "live")
		want(m, short, "expired")
		want(m, revoked, "revoked")
		want(m, usedUp, "used-up")

		// A revoked token that also expired still says revoked.
		mustOK(t, e.DB.SetClockOffset(ctx, 2*time.Hour))
		m = states(true)
		want(m, live, "expired")
		want(m, revoked, "revoked")
		if got := states(false); len(got) != 0 {
			t.Fatalf("live list after every token expired: %v", got)
		}
	})
}

// R2.6: revoke takes a token id of the pool, ends the token at once, and
// revoking twice is not an error.
func TestRevokeJoinToken(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, MaxUses: 3})
		other := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool2.Id})
		acmeTok := mkToken(t, w.acmeAdmin, &bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id})
		revoke := func(tenant, pool, id string) (*bcv1.JoinToken, error) {
			res, err := e.Admin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: tenant, PoolId: pool, TokenId: id}))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		}
		snap := settle(t, w, w.root, e.Admin, w.pool.Id)
		refused := []struct {
			name, tenant, pool, id string
			code                   errs.Code
			field                  string
		}{
			{"token of another pool", w.root, w.pool.Id, other.Id, errs.NotFound, ""},
			{"token of another tenant's pool", w.root, w.pool.Id, acmeTok.Id, errs.NotFound, ""},
			{"another tenant's pool", w.root, w.acmePool.Id, acmeTok.Id, errs.NotFound, ""},
			{"unknown token", w.root, w.pool.Id, "jt_01k5w0000000000000000000aa", errs.NotFound, ""},
			{"pasted bearer token", w.root, w.pool.Id, tok.Token, errs.InvalidArgument, "tokenId"},
			{"pasted bearer token without scheme", w.root, w.pool.Id, strings.TrimPrefix(tok.Token, "bcjt_"), errs.InvalidArgument, "tokenId"},
			{"not an id", w.root, w.pool.Id, "pool_x", errs.InvalidArgument, "tokenId"},
			{"empty id", w.root, w.pool.Id, "", errs.InvalidArgument, "tokenId"},
			{"no pool", w.root, "", tok.Id, errs.InvalidArgument, "poolId"},
		}
		for _, c := range refused {
			t.Run(c.name, func(t *testing.T) {
				_, err := revoke(c.tenant, c.pool, c.id)
				ee := wantErr(t, err, c.code, c.field)
				// A refused pasted token is never echoed back.
				if strings.Contains(ee.Message, strings.SplitN(tok.Token, ".", 2)[1]) {
					t.Fatalf("the message repeats the secret: %q", ee.Message)
				}
			})
		}
		// acme's admin cannot revoke root's token, whichever tenant it names.
		_, err := w.acmeAdmin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.acme, PoolId: w.pool.Id, TokenId: tok.Id}))
		wantErr(t, err, errs.NotFound, "")
		_, err = w.acmeAdmin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: tok.Id}))
		wantErr(t, err, errs.NotFound, "")
		// The refusals wrote nothing and revoked nothing.
		snap.unchanged(t, w, w.root, e.Admin, w.pool.Id)
		for pool, id := range map[string]string{w.pool.Id: tok.Id, w.pool2.Id: other.Id, w.acmePool.Id: acmeTok.Id} {
			if !slices.ContainsFunc(tokenRows(t, e.DB, pool), func(r store.JoinToken) bool { return r.ID == id && r.RevokedAt == nil }) {
				t.Fatalf("%s was revoked by a refused call", id)
			}
		}

		first, err := revoke(w.root, w.pool.Id, tok.Id)
		mustOK(t, err)
		if first.State != "revoked" || first.RevokedAt == nil || first.Token != "" || first.Id != tok.Id || first.UsesLeft != 3 {
			t.Fatalf("first revoke = %v", first)
		}
		second, err := revoke(w.root, w.pool.Id, tok.Id)
		mustOK(t, err)
		if second.State != "revoked" || !second.RevokedAt.AsTime().Equal(first.RevokedAt.AsTime()) {
			t.Fatalf("second revoke = %v, want the first revocation %v", second, first.RevokedAt.AsTime())
		}
		// Ended at once: gone from the live list.
		for _, it := range listAll(t, e.Admin, w.root, w.pool.Id, false, 0) {
			if it.Id == tok.Id {
				t.Fatal("a revoked token is listed as live")
			}
		}
		// Root may revoke acme's token acting for acme.
		got, err := revoke(w.acme, w.acmePool.Id, acmeTok.Id)
		mustOK(t, err)
		if got.State != "revoked" {
			t.Fatalf("acme token = %v", got)
		}
	})
}
