package api_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// createdBy returns the principal id an event names as its creator, which
// audit rows name as their actor.
func createdBy(t *testing.T, ev *bcv1.Event) string {
	t.Helper()
	s, _ := ev.Data.AsMap()["createdBy"].(string)
	if s == "" {
		t.Fatalf("%s without createdBy: %v", ev.Type, ev.Data.AsMap())
	}
	return s
}

// R2.4, R14.1, R14.2: creating and revoking tokens publishes
// security.join-token.created (pinned, hosted only when set) and
// security.join-token.revoked (first revoke only), readable with a cursor,
// with an audit row for each.
func TestJoinTokenEvents(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		_, start := eventsAfter(t, e.Admin, w.root, "", isEvent("pool.created", w.noAgent.Id))

		pinned := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TtlSeconds: 600, MaxUses: 4,
			Expect: &bcv1.Expect{Serial: "SN-7701"}, Hosted: "kubernetes", AllowReclaim: true})
		plain := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool2.Id, TtlSeconds: 600})
		for range 2 {
			_, err := e.Admin.JoinTokens.RevokeJoinToken(ctx, rq(&bcv1.RevokeJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id, TokenId: pinned.Id}))
			mustOK(t, err)
		}
		evs, end := eventsAfter(t, e.Admin, w.root, start, isEvent("security.join-token.revoked", pinned.Id))
		var got []string
		for _, ev := range evs {
			got = append(got, ev.Type+" "+ev.Subject)
		}
		want := []string{"security.join-token.created " + pinned.Id, "security.join-token.created " + plain.Id, "security.join-token.revoked " + pinned.Id}
		if !slices.Equal(got, want) {
			t.Fatalf("events = %v, want %v", got, want)
		}

		t.Run("created", func(t *testing.T) {
			for i, c := range []struct {
				tok    *bcv1.JoinToken
				pool   *bcv1.Pool
				pinned bool
				hosted string
			}{{pinned, w.pool, true, "kubernetes"}, {plain, w.pool2, false, ""}} {
				ev := evs[i]
				d := ev.Data.AsMap()
				if ev.TenantId != w.root || ev.Time == nil || ev.Id == "" {
					t.Fatalf("event %v", ev)
				}
				if d["tokenId"] != c.tok.Id || d["poolId"] != c.pool.Id || d["siteId"] != w.site.Id || d["role"] != "node" || d["pinned"] != c.pinned {
					t.Fatalf("created %s: data %v", c.tok.Id, d)
				}
				h, has := d["hosted"]
				if has != (c.hosted != "") || (has && h != c.hosted) {
					t.Fatalf("created %s: hosted %v present %v, want %q", c.tok.Id, h, has, c.hosted)
				}
				if _, ok := d["expiresAt"]; !ok {
					t.Fatalf("created %s: no expiresAt: %v", c.tok.Id, d)
				}
				createdBy(t, ev)
			}
			if d := evs[0].Data.AsMap(); d["maxUses"] != float64(4) || d["allowReclaim"] != true {
				t.Fatalf("created: data %v", d)
			}
		})
		t.Run("revoked", func(t *testing.T) {
			d := evs[2].Data.AsMap()
			if d["tokenId"] != pinned.Id || d["poolId"] != w.pool.Id || d["usesLeft"] != float64(4) || d["revokedBy"] != createdBy(t, evs[0]) {
				t.Fatalf("revoked: data %v", d)
			}
		})
		t.Run("cursor", func(t *testing.T) {
			// One at a time from the start: the same stream, each cursor
			// leading to the next event.
			var walked []*bcv1.Event
			cur := ""
			for range 1000 {
				res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: cur, Limit: 1}))
				mustOK(t, err)
				if len(res.Msg.Events) == 0 {
					if res.Msg.NextCursor != cur {
						t.Fatalf("empty page moved the cursor from %q to %q", cur, res.Msg.NextCursor)
					}
					break
				}
				if len(res.Msg.Events) != 1 || res.Msg.NextCursor != res.Msg.Events[0].Cursor {
					t.Fatalf("page = %v", res.Msg)
				}
				walked = append(walked, res.Msg.Events[0])
				cur = res.Msg.NextCursor
			}
			if cur != end {
				t.Fatalf("walk ended at %q, the bulk read at %q", cur, end)
			}
			tail := walked[len(walked)-3:]
			for i := range tail {
				if tail[i].Id != evs[i].Id {
					t.Fatalf("walk tail %v, want %v", tail, evs)
				}
			}
			// A prefix filters types.
			res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, TypePrefix: "security.join-token."}))
			mustOK(t, err)
			if len(res.Msg.Events) != 3 {
				t.Fatalf("prefix security.join-token.: %d events", len(res.Msg.Events))
			}
			res, err = e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, TypePrefix: "security.join-token.revoked"}))
			mustOK(t, err)
			if len(res.Msg.Events) != 1 || res.Msg.Events[0].Subject != pinned.Id {
				t.Fatalf("prefix security.join-token.revoked: %v", res.Msg.Events)
			}
		})
		t.Run("bad arguments", func(t *testing.T) {
			for _, c := range []struct {
				r     *bcv1.ListEventsRequest
				field string
			}{
				{&bcv1.ListEventsRequest{TenantId: w.root, Cursor: "nope"}, "cursor"},
				{&bcv1.ListEventsRequest{TenantId: w.root, Cursor: "-1.2"}, "cursor"},
				{&bcv1.ListEventsRequest{TenantId: w.root, Limit: -1}, "limit"},
				{&bcv1.ListEventsRequest{TenantId: w.root, WaitSeconds: 31}, "waitSeconds"},
				{&bcv1.ListEventsRequest{TenantId: w.root, WaitSeconds: -1}, "waitSeconds"},
				{&bcv1.ListEventsRequest{}, "tenantId"},
			} {
				_, err := e.Admin.Events.ListEvents(ctx, rq(c.r))
				wantErr(t, err, errs.InvalidArgument, c.field)
			}
			for _, c := range []string{"x", "-1", "0", "01", "1.2", "99999999999999999999"} {
				_, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, Cursor: c}))
				wantErr(t, err, errs.InvalidArgument, "cursor")
			}
			_, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, PageSize: -1}))
			wantErr(t, err, errs.InvalidArgument, "pageSize")
		})
		t.Run("long poll", func(t *testing.T) {
			// R14.1: a reader waiting at the end of the stream wakes when a
			// token is created.
			done := make(chan *bcv1.ListEventsResponse, 1)
			errc := make(chan error, 1)
			go func() {
				res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: end, WaitSeconds: 20}))
				if err != nil {
					errc <- err
					return
				}
				done <- res.Msg
			}()
			// Once the reader waits on the hub, the token's event wakes
			// it (or, registered but not yet past its read, it reads it).
			poll.Until(t, 10*time.Second, "the long poll to wait", func() bool { return e.Server.Hub().Waiting(w.root) > 0 })
			tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})
			select {
			case res := <-done:
				if len(res.Events) == 0 || res.Events[0].Subject != tok.Id {
					t.Fatalf("long poll = %v", res)
				}
			case err := <-errc:
				t.Fatal(err)
			case <-time.After(15 * time.Second):
				t.Fatal("long poll did not wake")
			}
		})
		t.Run("audit", func(t *testing.T) {
			// R14.2: who, what, when, on what. oldest
			// first with a cursor, the order events are read in.
			var tokenRows []*bcv1.AuditEntry
			for _, a := range auditAll(t, e.Admin, w.root) {
				if a.Action == "join-token.created" || a.Action == "join-token.revoked" {
					tokenRows = append(tokenRows, a)
				}
			}
			// Oldest first: pinned, plain, the revoke, the long poll's token.
			if len(tokenRows) != 4 {
				t.Fatalf("%d join-token audit rows: %v", len(tokenRows), tokenRows)
			}
			actor := createdBy(t, evs[0])
			for i, c := range []struct{ action, resource, token string }{
				{"join-token.created", "compute-pool/" + w.pool.Id, pinned.Id},
				{"join-token.created", "compute-pool/" + w.pool2.Id, plain.Id},
				{"join-token.revoked", "compute-pool/" + w.pool.Id, pinned.Id},
			} {
				a := tokenRows[i]
				if a.Action != c.action || a.Resource != c.resource || a.Actor != actor || a.Time == nil || a.TenantId != w.root || a.Data.AsMap()["tokenId"] != c.token {
					t.Fatalf("audit %d = %v, want %v by %s", i, a, c, actor)
				}
			}
			// Paging one row at a time with the cursor yields the same rows;
			// every row carries the cursor that reads on after it.
			var paged []string
			cur := ""
			for range 1000 {
				res, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, PageSize: 1, Cursor: cur}))
				mustOK(t, err)
				if len(res.Msg.Items) == 0 {
					if res.Msg.NextCursor != cur {
						t.Fatalf("an empty page moved the cursor from %q to %q", cur, res.Msg.NextCursor)
					}
					break
				}
				a := res.Msg.Items[0]
				if a.Cursor != res.Msg.NextCursor {
					t.Fatalf("row cursor %q, next cursor %q", a.Cursor, res.Msg.NextCursor)
				}
				paged = append(paged, a.Id)
				cur = res.Msg.NextCursor
			}
			var all []string
			for _, a := range auditAll(t, e.Admin, w.root) {
				all = append(all, a.Id)
			}
			if !slices.Equal(paged, all) {
				t.Fatalf("paged audit %v, bulk %v (want equal)", paged, all)
			}
			// The end cursor resumes later with exactly what came after.
			tok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})
			res, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, Cursor: cur}))
			mustOK(t, err)
			if len(res.Msg.Items) != 1 || res.Msg.Items[0].Action != "join-token.created" || res.Msg.Items[0].Data.AsMap()["tokenId"] != tok.Id {
				t.Fatalf("after the end cursor: %v", res.Msg.Items)
			}
		})
	})
}

// R14.1, R1.2: a tenant's events and audit are its own; another tenant
// reading them gets NOT_FOUND.
func TestEventsTenantIsolation(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		rootTok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})
		acmeTok := mkToken(t, w.acmeAdmin, &bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id})
		rootEvs, _ := eventsAfter(t, e.Admin, w.root, "", isEvent("security.join-token.created", rootTok.Id))
		acmeEvs, _ := eventsAfter(t, w.acmeAdmin, w.acme, "", isEvent("security.join-token.created", acmeTok.Id))
		for _, ev := range rootEvs {
			if ev.TenantId != w.root || ev.Subject == acmeTok.Id || ev.Subject == w.acmePool.Id {
				t.Fatalf("root's stream holds %v", ev)
			}
		}
		for _, ev := range acmeEvs {
			if ev.TenantId != w.acme || ev.Subject == rootTok.Id || ev.Subject == w.pool.Id {
				t.Fatalf("acme's stream holds %v", ev)
			}
		}
		for _, a := range auditAll(t, w.acmeAdmin, w.acme) {
			if a.TenantId != w.acme || a.Resource == "compute-pool/"+w.pool.Id {
				t.Fatalf("acme's audit holds %v", a)
			}
		}
		// Another tenant's stream and audit are NOT_FOUND, never
		// ACCESS_DENIED, even to an admin of a tenant.
		_, err := w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root}))
		wantErr(t, err, errs.NotFound, "")
		_, err = w.acmeAdmin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root}))
		wantErr(t, err, errs.NotFound, "")
		_, err = w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: "tn_01k5w0000000000000000000aa"}))
		wantErr(t, err, errs.NotFound, "")
		// The platform operator reads any tenant's stream.
		res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme}))
		mustOK(t, err)
		if len(res.Msg.Events) == 0 {
			t.Fatal("root reads no acme events")
		}
		// A key without compute:events:read is refused in its own tenant.
		scoped := mkKey(t, w.acmeAdmin, w.acme, "reader", &bcv1.Grant{Action: "compute:join-tokens:read", Resource: "compute-pool/" + w.acmePool.Id})
		_, err = e.Client(t, scoped).Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme}))
		wantErr(t, err, errs.AccessDenied, "")
		_, err = e.Client(t, scoped).Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.acme}))
		wantErr(t, err, errs.AccessDenied, "")
	})
}
