package api_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R2.2: the fields of joinTokens.create, their bounds and normalization,
// and the pool checks (daemon, owner tenant).
func TestCreateJoinTokenFields(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		type tc struct {
			name  string
			c     func() *bcv1.CreateJoinTokenRequest
			code  errs.Code // "" means success
			field string
			msg   string // a part of the message
			check func(t *testing.T, got *bcv1.JoinToken)
		}
		base := func(mod func(r *bcv1.CreateJoinTokenRequest)) func() *bcv1.CreateJoinTokenRequest {
			return func() *bcv1.CreateJoinTokenRequest {
				r := &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600}
				if mod != nil {
					mod(r)
				}
				return r
			}
		}
		ttl := func(want time.Duration) func(t *testing.T, got *bcv1.JoinToken) {
			return func(t *testing.T, got *bcv1.JoinToken) {
				if d := got.ExpiresAt.AsTime().Sub(got.CreatedAt.AsTime()); d != want {
					t.Fatalf("expiresAt - createdAt = %v, want %v", d, want)
				}
			}
		}
		uses := func(n int32) func(t *testing.T, got *bcv1.JoinToken) {
			return func(t *testing.T, got *bcv1.JoinToken) {
				if got.MaxUses != n || got.UsesLeft != n {
					t.Fatalf("maxUses %d usesLeft %d, want %d", got.MaxUses, got.UsesLeft, n)
				}
			}
		}
		expect := func(want *bcv1.Expect) func(t *testing.T, got *bcv1.JoinToken) {
			return func(t *testing.T, got *bcv1.JoinToken) {
				g := got.Expect
				if g.ProductUuid != want.ProductUuid || g.Serial != want.Serial || g.Mac != want.Mac || g.GpuUuid != want.GpuUuid {
					t.Fatalf("expect = %v, want %v", g, want)
				}
			}
		}
		cases := []tc{
			// R2.2: ttlSeconds 60..86400.
			{name: "ttl 59", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = 59 }), code: errs.InvalidArgument, field: "ttlSeconds", msg: "60"},
			{name: "ttl 86401", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = 86401 }), code: errs.InvalidArgument, field: "ttlSeconds", msg: "86400"},
			{name: "ttl missing", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = 0 }), code: errs.InvalidArgument, field: "ttlSeconds"},
			{name: "ttl negative", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = -60 }), code: errs.InvalidArgument, field: "ttlSeconds"},
			{name: "ttl 60", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = 60 }), check: ttl(time.Minute)},
			{name: "ttl 86400", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds = 86400 }), check: ttl(24 * time.Hour)},
			// R2.2: maxUses >= 1; 0 means 1.
			{name: "maxUses 0 is 1", c: base(nil), check: uses(1)},
			{name: "maxUses 7", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.MaxUses = 7 }), check: uses(7)},
			{name: "maxUses -1", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.MaxUses = -1 }), code: errs.InvalidArgument, field: "maxUses"},
			{name: "maxUses huge", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.MaxUses = 1 << 30 }), code: errs.InvalidArgument, field: "maxUses"},
			// R2.2: hosted is "" or kubernetes.
			{name: "hosted kubernetes", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Hosted = "kubernetes" }), check: func(t *testing.T, got *bcv1.JoinToken) {
				if got.Hosted != "kubernetes" {
					t.Fatalf("hosted = %q", got.Hosted)
				}
			}},
			{name: "hosted docker", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Hosted = "docker" }), code: errs.InvalidArgument, field: "hosted", msg: "kubernetes"},
			{name: "hosted Kubernetes", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Hosted = "Kubernetes" }), code: errs.InvalidArgument, field: "hosted"},
			// R2.2, R5: expect is normalized, and a value that never matches
			// is refused naming its field.
			{name: "expect normalized", c: base(func(r *bcv1.CreateJoinTokenRequest) {
				r.Expect = &bcv1.Expect{ProductUuid: "4C4C4544-0042-3510-8052-B7C04F4E3232", Serial: " SN-7701 ", Mac: "00-1B-21-AA-BB-CC", GpuUuid: "GPU-5F1E0E7C-1111-2222-3333-444455556666"}
			}), check: expect(&bcv1.Expect{ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4e3232", Serial: "SN-7701", Mac: "00:1b:21:aa:bb:cc", GpuUuid: "gpu-5f1e0e7c-1111-2222-3333-444455556666"})},
			{name: "expect.mac locally administered", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Mac: "02:00:00:aa:bb:cc"} }), code: errs.InvalidArgument, field: "expect.mac", msg: "globally administered"},
			{name: "expect.mac multicast", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Mac: "01:00:5e:00:00:01"} }), code: errs.InvalidArgument, field: "expect.mac"},
			{name: "expect.mac zero", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Mac: "00:00:00:00:00:00"} }), code: errs.InvalidArgument, field: "expect.mac"},
			{name: "expect.mac garbage", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Mac: "eth0"} }), code: errs.InvalidArgument, field: "expect.mac"},
			{name: "expect.productUuid not a UUID", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{ProductUuid: "not-a-uuid"} }), code: errs.InvalidArgument, field: "expect.productUuid"},
			{name: "expect.productUuid placeholder", c: base(func(r *bcv1.CreateJoinTokenRequest) {
				r.Expect = &bcv1.Expect{ProductUuid: "03000200-0400-0500-0006-000700080009"}
			}), code: errs.InvalidArgument, field: "expect.productUuid", msg: "placeholder"},
			{name: "expect.productUuid all zero", c: base(func(r *bcv1.CreateJoinTokenRequest) {
				r.Expect = &bcv1.Expect{ProductUuid: "00000000-0000-0000-0000-000000000000"}
			}), code: errs.InvalidArgument, field: "expect.productUuid"},
			{name: "expect.serial placeholder", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Serial: "To Be Filled By O.E.M."} }), code: errs.InvalidArgument, field: "expect.serial", msg: "placeholder"},
			{name: "expect.serial blank", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Serial: "   "} }), code: errs.InvalidArgument, field: "expect.serial"},
			{name: "expect.serial control character", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{Serial: "SN\x00-1"} }), code: errs.InvalidArgument, field: "expect.serial"},
			{name: "expect.gpuUuid placeholder", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = &bcv1.Expect{GpuUuid: "N/A"} }), code: errs.InvalidArgument, field: "expect.gpuUuid"},
			// Idempotency keys are bounded, printable, without spaces.
			{name: "idempotencyKey with a space", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.IdempotencyKey = "rack b7" }), code: errs.InvalidArgument, field: "idempotencyKey"},
			{name: "idempotencyKey too long", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.IdempotencyKey = strings.Repeat("k", 129) }), code: errs.InvalidArgument, field: "idempotencyKey"},
			{name: "idempotencyKey 128", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.IdempotencyKey = strings.Repeat("k", 128) })},
			// R2.2: the tenant and pool.
			{name: "no tenantId", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TenantId = "" }), code: errs.InvalidArgument, field: "tenantId"},
			{name: "no poolId", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.PoolId = "" }), code: errs.InvalidArgument, field: "poolId"},
			{name: "unknown pool", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.PoolId = "pool_01k5w00000000000000000000" }), code: errs.NotFound},
			{name: "pool without daemon", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.PoolId = w.noAgent.Id }), code: errs.InvalidState, msg: "bcd"},
			// R2.2, R1.2: a pool of another tenant is NOT_FOUND, never
			// ACCESS_DENIED.
			{name: "another tenant's pool", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.PoolId = w.acmePool.Id }), code: errs.NotFound, msg: w.acmePool.Id},
			// R1.2: root principals may act for any tenant, with that
			// tenant's pools.
			{name: "root for acme", c: base(func(r *bcv1.CreateJoinTokenRequest) { r.TenantId, r.PoolId = w.acme, w.acmePool.Id })},
		}
		ctx := context.Background()
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				r := c.c()
				got, err := e.Admin.JoinTokens.CreateJoinToken(ctx, rq(r))
				if c.code != "" {
					ee := wantErr(t, err, c.code, c.field)
					if c.msg != "" && !strings.Contains(ee.Message, c.msg) {
						t.Fatalf("message %q does not mention %q", ee.Message, c.msg)
					}
					return
				}
				mustOK(t, err)
				tok := got.Msg
				// R2.3: the answer is the record plus the token.
				if !strings.HasPrefix(tok.Token, "bcjt_"+tok.Id+".") || !strings.HasPrefix(tok.Id, "jt_") {
					t.Fatalf("token %q for id %q", tok.Token, tok.Id)
				}
				if tok.PoolId != r.PoolId || tok.Role != "node" || tok.State != "live" || tok.SiteId == "" || tok.Expect == nil {
					t.Fatalf("record = %v", tok)
				}
				if c.check != nil {
					c.check(t, tok)
				}
			})
		}
		// acme's own admin: another tenant's pool and another tenant are
		// both NOT_FOUND.
		_, err := w.acmeAdmin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.pool.Id, TtlSeconds: 3600}))
		wantErr(t, err, errs.NotFound, "")
		_, err = w.acmeAdmin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600}))
		wantErr(t, err, errs.NotFound, "")
		tok, err := w.acmeAdmin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id, TtlSeconds: 3600}))
		mustOK(t, err)
		if tok.Msg.SiteId != w.acmeSite.Id || tok.Msg.Token == "" {
			t.Fatalf("acme token = %v", tok.Msg)
		}
	})
}

// R2.3: an idempotency key replays the record without the token; another
// pool, expect, allowReclaim or hosted under the same key is CONFLICT.
func TestCreateJoinTokenIdempotency(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		first := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600, MaxUses: 2,
			Expect: &bcv1.Expect{Serial: "SN-7701", Mac: "00:1b:21:aa:bb:cc"}, IdempotencyKey: "adopt-rack-b7-u12"})
		if first.Token == "" {
			t.Fatal("first create carries no token")
		}
		// Allowed only on pool2 (made before the snapshot: it writes an
		// event and an audit row).
		pool2Only := e.Client(t, mkKey(t, e.Admin, w.root, "pool2-minter",
			&bcv1.Grant{Action: "compute:join-tokens:create", Resource: "compute-pool/" + w.pool2.Id}))
		snap := settle(t, w, w.root, e.Admin, w.pool.Id)

		same := func(mod func(r *bcv1.CreateJoinTokenRequest)) *bcv1.CreateJoinTokenRequest {
			r := &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 3600, MaxUses: 2,
				Expect: &bcv1.Expect{Serial: "SN-7701", Mac: "00:1b:21:aa:bb:cc"}, IdempotencyKey: "adopt-rack-b7-u12"}
			if mod != nil {
				mod(r)
			}
			return r
		}
		replays := []struct {
			name string
			r    *bcv1.CreateJoinTokenRequest
		}{
			{"identical", same(nil)},
			// The binding is compared after normalization.
			{"expect in another spelling", same(func(r *bcv1.CreateJoinTokenRequest) {
				r.Expect = &bcv1.Expect{Serial: " SN-7701", Mac: "00-1B-21-AA-BB-CC"}
			})},
			// Only pool, expect, allowReclaim and hosted make a conflict.
			{"other ttl and maxUses", same(func(r *bcv1.CreateJoinTokenRequest) { r.TtlSeconds, r.MaxUses = 60, 9 })},
		}
		for _, c := range replays {
			t.Run("replay "+c.name, func(t *testing.T) {
				got, err := e.Admin.JoinTokens.CreateJoinToken(ctx, rq(c.r))
				mustOK(t, err)
				if got.Msg.Id != first.Id || got.Msg.Token != "" {
					t.Fatalf("replay = id %s token %q, want id %s without token", got.Msg.Id, got.Msg.Token, first.Id)
				}
				if got.Msg.MaxUses != 2 || !got.Msg.ExpiresAt.AsTime().Equal(first.ExpiresAt.AsTime()) || got.Msg.Expect.Mac != "00:1b:21:aa:bb:cc" {
					t.Fatalf("replay record = %v, want the first record %v", got.Msg, first)
				}
			})
		}
		conflicts := []struct {
			name, field string
			r           *bcv1.CreateJoinTokenRequest
		}{
			{"another expect", "expect", same(func(r *bcv1.CreateJoinTokenRequest) { r.Expect.Serial = "SN-7702" })},
			{"expect dropped", "expect", same(func(r *bcv1.CreateJoinTokenRequest) { r.Expect = nil })},
			{"expect widened", "expect", same(func(r *bcv1.CreateJoinTokenRequest) { r.Expect.GpuUuid = "GPU-5f1e0e7c-1111-2222-3333-444455556666" })},
			{"another allowReclaim", "allowReclaim", same(func(r *bcv1.CreateJoinTokenRequest) { r.AllowReclaim = true })},
			{"another hosted", "hosted", same(func(r *bcv1.CreateJoinTokenRequest) { r.Hosted = "kubernetes" })},
		}
		for _, c := range conflicts {
			t.Run("conflict "+c.name, func(t *testing.T) {
				_, err := e.Admin.JoinTokens.CreateJoinToken(ctx, rq(c.r))
				ee := wantErr(t, err, errs.Conflict, "")
				if !strings.Contains(ee.Message, c.field) || !strings.Contains(ee.Message, first.Id) {
					t.Fatalf("message %q should name %s and %s", ee.Message, c.field, first.Id)
				}
			})
		}
		// keys are per tenant, so the same key in another
		// pool is a CONFLICT, but one that names nothing of the other pool:
		// a caller allowed only on pool2 must not learn the token id (or
		// the pool) of a token it cannot see. Even the admin, who could
		// see it, gets the same answer: it does not depend on who asks.
		for name, c := range map[string]*client.Client{"pool2 minter": pool2Only, "admin": e.Admin} {
			t.Run("conflict another pool, "+name, func(t *testing.T) {
				_, err := c.JoinTokens.CreateJoinToken(ctx, rq(same(func(r *bcv1.CreateJoinTokenRequest) { r.PoolId = w.pool2.Id })))
				ee := wantErr(t, err, errs.Conflict, "")
				want := `idempotency key "adopt-rack-b7-u12" is already used in this tenant for another request; choose another key`
				if ee.Message != want {
					t.Fatalf("message %q, want %q", ee.Message, want)
				}
				if strings.Contains(ee.Message, first.Id) || strings.Contains(ee.Message, w.pool.Id) {
					t.Fatalf("message %q reveals the other pool's token", ee.Message)
				}
			})
		}

		// Nothing half-written: replays and conflicts left no token, no
		// event, no audit row.
		snap.unchanged(t, w, w.root, e.Admin, w.pool.Id)

		// A revoked token still replays (its record, no token).
		_, err := e.Admin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: first.Id}))
		mustOK(t, err)
		got, err := e.Admin.JoinTokens.CreateJoinToken(ctx, rq(same(nil)))
		mustOK(t, err)
		if got.Msg.Id != first.Id || got.Msg.Token != "" || got.Msg.State != "revoked" {
			t.Fatalf("replay of a revoked token = %v", got.Msg)
		}

		// Keys are per tenant: acme may use the same key for its own pool.
		acme, err := w.acmeAdmin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id, TtlSeconds: 3600,
			IdempotencyKey: "adopt-rack-b7-u12"}))
		mustOK(t, err)
		if acme.Msg.Id == first.Id || acme.Msg.Token == "" {
			t.Fatalf("acme's token under the same key = %v", acme.Msg)
		}
		// And a key of one tenant is no oracle for another: acme's replay
		// with root's pool is NOT_FOUND, not CONFLICT.
		_, err = w.acmeAdmin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.pool.Id, TtlSeconds: 3600,
			IdempotencyKey: "adopt-rack-b7-u12"}))
		wantErr(t, err, errs.NotFound, "")
	})
}

// R2.3, R14.1: concurrent creates with one idempotency key make exactly one
// token, one event and one audit row; every answer names it, and exactly
// one carries the secret.
func TestCreateJoinTokenIdempotencyConcurrent(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		const n = 10
		var wg sync.WaitGroup
		res := make([]*bcv1.JoinToken, n)
		errv := make([]error, n)
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				r, err := e.Admin.JoinTokens.CreateJoinToken(ctx, rq(&bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 600,
					Expect: &bcv1.Expect{Serial: "SN-RACE"}, IdempotencyKey: "race-1"}))
				errv[i] = err
				if err == nil {
					res[i] = r.Msg
				}
			})
		}
		close(start)
		wg.Wait()
		withToken := 0
		for i := range n {
			if errv[i] != nil {
				t.Fatalf("create %d: %v", i, errv[i])
			}
			if res[i].Id != res[0].Id {
				t.Fatalf("answers name %s and %s", res[0].Id, res[i].Id)
			}
			if res[i].Token != "" {
				withToken++
			}
		}
		if withToken != 1 {
			t.Fatalf("%d answers carry the token, want 1", withToken)
		}
		if rows := tokenRows(t, e.DB, w.pool.Id); len(rows) != 1 || rows[0].ID != res[0].Id {
			t.Fatalf("%d token rows", len(rows))
		}
		// Nothing half-written by the losers: one created event, one audit
		// row for the token.
		settle(t, w, w.root, e.Admin, w.pool.Id)
		evs, _ := eventsAfter(t, e.Admin, w.root, "", nil)
		created := 0
		for _, ev := range evs {
			if ev.Type == "security.join-token.created" && ev.Subject == res[0].Id {
				created++
			}
		}
		audits := 0
		for _, a := range auditAll(t, e.Admin, w.root) {
			if a.Action == "join-token.created" && a.Data.AsMap()["tokenId"] == res[0].Id {
				audits++
			}
		}
		if created != 1 || audits != 1 {
			t.Fatalf("%d created events and %d audit rows for %s, want 1 and 1", created, audits, res[0].Id)
		}
	})
}

// R2.1: the database holds only SHA-256 of the secret. The join_tokens row
// is read through the store; the events and audit rows are searched for the
// secret; on SQLite the database files themselves are searched too.
func TestJoinTokenSecretNotStored(t *testing.T) {
	for _, dialect := range []string{"sqlite", "postgres"} {
		t.Run(dialect, func(t *testing.T) {
			var db *store.DB
			var dir string
			if dialect == "sqlite" {
				dir = t.TempDir()
				var err error
				db, err = store.Open(context.Background(), store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}, nil)
				mustOK(t, err)
				t.Cleanup(func() { db.Close() })
			} else {
				db = storetest.OpenPostgres(t)
			}
			e := apitest.Start(t, db, apitest.Options{NoJoin: true})
			w := newWorld(t, e)
			ctx := context.Background()
			tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, MaxUses: 3,
				Expect: &bcv1.Expect{Serial: "SN-1"}, IdempotencyKey: "r21"})
			// R2.1: bcjt_<id>.<secret>, the secret 256 bits of base64url.
			rest, ok := strings.CutPrefix(tok.Token, "bcjt_")
			id, plain, ok2 := strings.Cut(rest, ".")
			if !ok || !ok2 || id != tok.Id || len(plain) != 43 || strings.ContainsAny(plain, "+/=") {
				t.Fatalf("token %q is not bcjt_<id>.<43 chars of base64url>", tok.Token)
			}
			_, err := e.Admin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: tok.Id}))
			mustOK(t, err)
			settle(t, w, w.root, e.Admin, w.pool.Id)

			var row store.JoinToken
			var evs []store.Event
			var audit []store.AuditEntry
			err = db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				if row, err = tx.GetJoinToken(ctx, tok.Id); err != nil {
					return err
				}
				if evs, err = tx.ListEvents(ctx, w.root, 0, 0, "", 1000); err != nil {
					return err
				}
				audit, err = tx.ListAudit(ctx, w.root, 0, 1000)
				return err
			})
			mustOK(t, err)
			sum := sha256.Sum256([]byte(plain))
			if !bytes.Equal(row.SecretSHA256, sum[:]) {
				t.Fatalf("stored hash %x, want sha256(secret) %x", row.SecretSHA256, sum)
			}
			fields := strings.Join([]string{row.ID, row.TenantID, row.PoolID, row.SiteID, row.Role, string(row.Expect), row.Hosted, row.IdempotencyKey, row.CreatedBy}, "\n")
			if strings.Contains(fields, plain) || bytes.Contains(row.SecretSHA256, []byte(plain)) {
				t.Fatal("the token row holds the secret")
			}
			if len(evs) == 0 || len(audit) == 0 {
				t.Fatalf("%d events, %d audit rows", len(evs), len(audit))
			}
			for _, ev := range evs {
				if bytes.Contains(ev.Data, []byte(plain)) || strings.Contains(ev.Subject, plain) {
					t.Fatalf("event %s holds the secret: %s", ev.Type, ev.Data)
				}
			}
			for _, a := range audit {
				if bytes.Contains(a.Data, []byte(plain)) || strings.Contains(a.Resource, plain) {
					t.Fatalf("audit %s holds the secret: %s", a.Action, a.Data)
				}
			}
			// The API never shows it again either.
			for _, it := range listAll(t, e.Admin, w.root, w.pool.Id, true, 0) {
				if it.Token != "" {
					t.Fatalf("list shows a token: %v", it)
				}
			}
			if dir != "" {
				files, _ := filepath.Glob(filepath.Join(dir, "bc.db*"))
				if len(files) == 0 {
					t.Fatal("no database files")
				}
				for _, f := range files {
					b, err := os.ReadFile(f)
					mustOK(t, err)
					if bytes.Contains(b, []byte(plain)) {
						t.Fatalf("%s holds the secret", filepath.Base(f))
					}
				}
			}
		})
	}
}
