package api_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// insertRequests stores n pending join requests of distinct machines in
// the pool, as JoinService would, and returns them in id order (each made
// a millisecond after the last, so ids sort as made).
func insertRequests(t testing.TB, db *store.DB, pool *bcv1.Pool, n int) []store.JoinRequest {
	t.Helper()
	ctx := context.Background()
	out := make([]store.JoinRequest, 0, n)
	base := time.Now()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		for i := range n {
			csr := sha256.Sum256([]byte(fmt.Sprintf("csr %s %d %d", pool.Id, i, time.Now().UnixNano())))
			r, err := tx.InsertJoinRequest(ctx, store.JoinRequest{ID: ids.New(ids.JoinRequest, base.Add(time.Duration(i)*time.Millisecond)), TenantID: pool.OwnerTenantId,
				PoolID: pool.Id, SiteID: pool.SiteId, Attestor: "discovery", Role: "ramdisk", MachineKey: fmt.Sprintf("mac:%s:%d", pool.Id, i),
				Claims: []byte(`{"productSerial":"SN-` + fmt.Sprint(i) + `","hostname":"pxe-` + fmt.Sprint(i) + `"}`), HardwareKey: []byte{0xab, 0xcd, byte(i)},
				MAC: fmt.Sprintf("52:54:00:00:%02x:%02x", i/256, i%256), IP: "10.0.0.9", WorkflowID: "wf-9", VouchedBy: "node_site", BootLeaseEpoch: 7,
				CSRSHA256: csr[:]})
			if err != nil {
				return err
			}
			out = append(out, r)
		}
		return nil
	})
	mustOK(t, err)
	return out
}

// R10.1, R10.2: a pool's requests list in pages of 100 by default and at
// most 200, with a cursor; pending only by default, every state with
// "all", or the states named.
func TestJoinRequestsListPagingR10_2(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		reqs := insertRequests(t, e.DB, w.pool, 230)
		insertRequests(t, e.DB, w.pool2, 3)
		list := func(r *bcv1.ListJoinRequestsRequest) *bcv1.ListJoinRequestsResponse {
			t.Helper()
			r.TenantId, r.PoolId = w.root, w.pool.Id
			res, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(r))
			mustOK(t, err)
			return res.Msg
		}
		if got := list(&bcv1.ListJoinRequestsRequest{}); len(got.Items) != 100 || got.NextPageToken != reqs[99].ID {
			t.Fatalf("default page: %d items, next %q", len(got.Items), got.NextPageToken)
		}
		if got := list(&bcv1.ListJoinRequestsRequest{PageSize: 1000}); len(got.Items) != 200 || got.NextPageToken != reqs[199].ID {
			t.Fatalf("page of 1000: %d items, next %q", len(got.Items), got.NextPageToken)
		}
		var seen []string
		for tok := ""; ; {
			page := list(&bcv1.ListJoinRequestsRequest{PageSize: 64, PageToken: tok})
			for _, r := range page.Items {
				seen = append(seen, r.Id)
			}
			if tok = page.NextPageToken; tok == "" {
				break
			}
		}
		want := make([]string, 0, len(reqs))
		for _, r := range reqs {
			want = append(want, r.ID)
		}
		if !slices.Equal(seen, want) {
			t.Fatalf("walked %d requests, want the pool's %d in id order", len(seen), len(want))
		}

		// Decided requests leave the default list and show with "all" or
		// their state.
		_, err := e.Admin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, Reason: "unknown serial"}))
		mustOK(t, err)
		_, err = e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[1].ID,
			TtlSeconds: 900, Reason: "rack B7 intake"}))
		mustOK(t, err)
		if got := list(&bcv1.ListJoinRequestsRequest{}); got.Items[0].Id != reqs[2].ID {
			t.Fatalf("pending list starts at %s, want %s", got.Items[0].Id, reqs[2].ID)
		}
		if got := list(&bcv1.ListJoinRequestsRequest{State: []string{"all"}, PageSize: 2}); got.Items[0].State != "rejected" || got.Items[1].State != "approved" {
			t.Fatalf("all: %v", got.Items)
		}
		if got := list(&bcv1.ListJoinRequestsRequest{State: []string{"approved", "rejected"}}); len(got.Items) != 2 || got.NextPageToken != "" {
			t.Fatalf("approved and rejected: %v", got.Items)
		}
		for _, bad := range [][]string{{"bogus"}, {"all", "pending"}, {strings.Repeat("x", 1000)}} {
			_, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id, State: bad}))
			wantErr(t, err, errs.InvalidArgument, "state")
		}
		_, err = e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id, PageSize: -1}))
		wantErr(t, err, errs.InvalidArgument, "pageSize")
	})
}

// R10.2, R10.3: approving shows every field of the request and the
// decision; the TTL is 60 to 86400 s; a reason is required; only a pending
// request is decided; decisions publish events and write audit rows.
func TestJoinRequestApproveRejectR10_3(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		reqs := insertRequests(t, e.DB, w.pool, 4)
		approve := func(id string, ttl int32, reason string) (*bcv1.JoinRequest, error) {
			res, err := e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: id,
				TtlSeconds: ttl, Reason: reason}))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		}
		reject := func(id, reason string) (*bcv1.JoinRequest, error) {
			res, err := e.Admin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: id, Reason: reason}))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		}
		for _, ttl := range []int32{59, 86401, 0, -60} {
			_, err := approve(reqs[0].ID, ttl, "ok")
			wantErr(t, err, errs.InvalidArgument, "ttlSeconds")
		}
		for _, reason := range []string{"", "   ", strings.Repeat("r", 257), "two\nlines", "esc\x1b[2J"} {
			_, err := approve(reqs[0].ID, 900, reason)
			wantErr(t, err, errs.InvalidArgument, "reason")
			_, err = reject(reqs[0].ID, reason)
			wantErr(t, err, errs.InvalidArgument, "reason")
		}
		_, err := approve("jt_01k5w0000000000000000000zz", 900, "ok")
		wantErr(t, err, errs.InvalidArgument, "requestId")

		before := time.Now().Add(-time.Second)
		got, err := approve(reqs[0].ID, 60, "rack B7 intake, ticket 4411")
		mustOK(t, err)
		r := reqs[0]
		if got.Id != r.ID || got.PoolId != w.pool.Id || got.SiteId != w.site.Id || got.Attestor != "discovery" || got.Claims.AsMap()["productSerial"] != "SN-0" ||
			got.HardwareKey != hex.EncodeToString(r.HardwareKey) || got.Mac != r.MAC || got.Ip != "10.0.0.9" || got.WorkflowId != "wf-9" ||
			got.VouchedBy != "node_site" || got.BootLeaseEpoch != 7 || got.CsrSha256 != hex.EncodeToString(r.CSRSHA256) || got.State != "approved" ||
			got.DecidedBy == "" || got.Reason != "rack B7 intake, ticket 4411" || got.DecidedAt.AsTime().Before(before) ||
			got.ApprovedUntil.AsTime().Sub(got.DecidedAt.AsTime()) != time.Minute || got.ConsumedAt != nil || got.NodeId != "" || got.CreatedAt == nil {
			t.Fatalf("approved %v", got)
		}
		if _, err := approve(reqs[1].ID, 86400, "a day"); err != nil {
			t.Fatal(err)
		}
		rej, err := reject(reqs[2].ID, "unknown serial")
		mustOK(t, err)
		if rej.State != "rejected" || rej.ApprovedUntil != nil || rej.Reason != "unknown serial" {
			t.Fatalf("rejected %v", rej)
		}
		// R10.3: deciding twice, either way, is INVALID_STATE.
		for _, call := range []func() error{
			func() error { _, err := approve(reqs[0].ID, 900, "again"); return err },
			func() error { _, err := reject(reqs[0].ID, "again"); return err },
			func() error { _, err := approve(reqs[2].ID, 900, "again"); return err },
			func() error { _, err := reject(reqs[2].ID, "again"); return err },
		} {
			wantErr(t, call(), errs.InvalidState, "")
		}
		// A consumed approval shows when and by which node.
		at := time.Now()
		mustOK(t, e.DB.WithTx(ctx, func(tx *store.Tx) error {
			return tx.ConsumeJoinRequest(ctx, reqs[1].ID, "node_01k5w0000000000000000000aa", at)
		}))
		res, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id, State: []string{"consumed"}}))
		mustOK(t, err)
		if len(res.Msg.Items) != 1 || res.Msg.Items[0].NodeId != "node_01k5w0000000000000000000aa" || res.Msg.Items[0].ConsumedAt == nil {
			t.Fatalf("consumed %v", res.Msg.Items)
		}
		_, err = reject(reqs[1].ID, "too late")
		wantErr(t, err, errs.InvalidState, "")

		// Events and audit rows, one per decision, with the request's data.
		evs, _ := eventsAfter(t, e.Admin, w.root, "", isEvent("security.join-request.rejected", reqs[2].ID))
		var decided []string
		for _, ev := range evs {
			if !strings.HasPrefix(ev.Type, "security.join-request.") {
				continue
			}
			decided = append(decided, ev.Type+" "+ev.Subject)
			if ev.Subject == reqs[0].ID {
				d := ev.Data.AsMap()
				if d["requestId"] != r.ID || d["poolId"] != w.pool.Id || d["siteId"] != w.site.Id || d["attestor"] != "discovery" || d["mac"] != r.MAC ||
					d["hardwareKey"] != hex.EncodeToString(r.HardwareKey) || d["csrSha256"] != hex.EncodeToString(r.CSRSHA256) || d["ttlSeconds"] != float64(60) ||
					d["reason"] != "rack B7 intake, ticket 4411" || d["decidedBy"] != got.DecidedBy {
					t.Fatalf("approved event data %v", d)
				}
			}
		}
		wantEvents := []string{"security.join-request.approved " + reqs[0].ID, "security.join-request.approved " + reqs[1].ID, "security.join-request.rejected " + reqs[2].ID}
		if !slices.Equal(decided, wantEvents) {
			t.Fatalf("events %v, want %v", decided, wantEvents)
		}
		var audits []string
		for _, a := range auditAll(t, e.Admin, w.root) {
			if strings.HasPrefix(a.Action, "join-request.") {
				audits = append(audits, a.Action+" "+a.Resource)
				if a.Actor != got.DecidedBy {
					t.Fatalf("audit actor %s, want %s", a.Actor, got.DecidedBy)
				}
			}
		}
		wantAudit := []string{"join-request.approved compute-join-request/" + reqs[0].ID, "join-request.approved compute-join-request/" + reqs[1].ID,
			"join-request.rejected compute-join-request/" + reqs[2].ID}
		if !slices.Equal(audits, wantAudit) {
			t.Fatalf("audit %v, want %v", audits, wantAudit)
		}
	})
}

// R10.3: an approval that ran out unused shows as expired (computed on
// read), lists under "expired" rather than "approved", and cannot be
// decided again.
func TestJoinRequestApprovalExpiresR10_3(t *testing.T) {
	fake := clock.NewFake(time.Now())
	apitest.Each(t, apitest.Options{NoJoin: true, Clock: fake}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		reqs := insertRequests(t, e.DB, w.pool, 2)
		_, err := e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID,
			TtlSeconds: 60, Reason: "short"}))
		mustOK(t, err)
		states := func(state ...string) []string {
			res, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id, State: state}))
			mustOK(t, err)
			var out []string
			for _, r := range res.Msg.Items {
				out = append(out, r.Id+" "+r.State)
			}
			return out
		}
		if got := states("approved"); !slices.Equal(got, []string{reqs[0].ID + " approved"}) {
			t.Fatalf("approved: %v", got)
		}
		fake.Advance(60 * time.Second)
		if got := states("approved"); len(got) != 0 {
			t.Fatalf("approved after expiry: %v", got)
		}
		if got := states("expired"); !slices.Equal(got, []string{reqs[0].ID + " expired"}) {
			t.Fatalf("expired: %v", got)
		}
		if got := states("all"); !slices.Equal(got, []string{reqs[0].ID + " expired", reqs[1].ID + " pending"}) {
			t.Fatalf("all: %v", got)
		}
		_, err = e.Admin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, Reason: "late"}))
		if e := wantErr(t, err, errs.InvalidState, ""); !strings.Contains(e.Message, "expired") {
			t.Fatalf("message %q", e.Message)
		}
		// Stored as expired (as JoinService does when a retry finds it
		// run out), it still shows as expired.
		mustOK(t, e.DB.WithTx(ctx, func(tx *store.Tx) error { return tx.ExpireJoinRequest(ctx, reqs[0].ID, fake.Now()) }))
		if got := states("expired"); !slices.Equal(got, []string{reqs[0].ID + " expired"}) {
			t.Fatalf("stored expired: %v", got)
		}
	})
}

// R1.2, R10.1: join requests are decided on the pool: read, approve and
// reject are separate grants; another tenant's or pool's request is
// NOT_FOUND.
func TestJoinRequestsAuthzR10_1(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		reqs := insertRequests(t, e.DB, w.pool, 3)
		acmeReqs := insertRequests(t, e.DB, w.acmePool, 1)
		poolRes := "compute-pool/" + w.pool.Id
		reader := e.Client(t, mkKey(t, e.Admin, w.root, "jr-reader", &bcv1.Grant{Action: "compute:join-requests:read", Resource: poolRes}))
		approver := e.Client(t, mkKey(t, e.Admin, w.root, "jr-approver", &bcv1.Grant{Action: "compute:join-requests:approve", Resource: poolRes}))
		rejecter := e.Client(t, mkKey(t, e.Admin, w.root, "jr-rejecter", &bcv1.Grant{Action: "compute:join-requests:reject", Resource: poolRes}))
		type call func() error
		cases := []struct {
			name string
			call call
			code errs.Code
		}{
			{"reader lists", func() error {
				_, err := reader.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id}))
				return err
			}, ""},
			{"reader cannot approve", func() error {
				_, err := reader.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, errs.AccessDenied},
			{"reader cannot reject", func() error {
				_, err := reader.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, Reason: "x"}))
				return err
			}, errs.AccessDenied},
			{"approver cannot list", func() error {
				_, err := approver.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.root, PoolId: w.pool.Id}))
				return err
			}, errs.AccessDenied},
			{"approver cannot reject", func() error {
				_, err := approver.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, Reason: "x"}))
				return err
			}, errs.AccessDenied},
			{"approver cannot approve in another pool", func() error {
				_, err := approver.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool2.Id, RequestId: reqs[0].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, errs.AccessDenied},
			{"rejecter cannot approve", func() error {
				_, err := rejecter.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, errs.AccessDenied},
			{"the request named under another pool", func() error {
				_, err := e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool2.Id, RequestId: reqs[0].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, errs.NotFound},
			{"a missing request", func() error {
				_, err := e.Admin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: "jreq_01k5w0000000000000000000zz", Reason: "x"}))
				return err
			}, errs.NotFound},
			{"R1.2 another tenant's request in the caller's pool", func() error {
				_, err := w.acmeAdmin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.acme, PoolId: w.acmePool.Id, RequestId: reqs[0].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, errs.NotFound},
			{"R1.2 another tenant's pool", func() error {
				_, err := w.acmeAdmin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: w.acme, PoolId: w.pool.Id}))
				return err
			}, errs.NotFound},
			{"R1.2 another tenant", func() error {
				_, err := w.acmeAdmin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[0].ID, Reason: "x"}))
				return err
			}, errs.NotFound},
			{"root's request named from acme's pool by root", func() error {
				_, err := e.Admin.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.acme, PoolId: w.acmePool.Id, RequestId: reqs[0].ID, Reason: "x"}))
				return err
			}, errs.NotFound},
			{"approver approves", func() error {
				_, err := approver.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[1].ID, TtlSeconds: 900, Reason: "x"}))
				return err
			}, ""},
			{"rejecter rejects", func() error {
				_, err := rejecter.JoinRequests.RejectJoinRequest(ctx, rq(&bcv1.RejectJoinRequestRequest{TenantId: w.root, PoolId: w.pool.Id, RequestId: reqs[2].ID, Reason: "x"}))
				return err
			}, ""},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				err := tc.call()
				if tc.code == "" {
					mustOK(t, err)
					return
				}
				wantErr(t, err, tc.code, "")
			})
		}
		// The refused calls decided nothing.
		var states []string
		mustOK(t, e.DB.ReadTx(ctx, func(tx *store.Tx) error {
			for _, id := range []string{reqs[0].ID, acmeReqs[0].ID} {
				r, err := tx.GetJoinRequest(ctx, id)
				if err != nil {
					return err
				}
				states = append(states, r.State)
			}
			return nil
		}))
		if !slices.Equal(states, []string{"pending", "pending"}) {
			t.Fatalf("states after refused calls: %v", states)
		}
	})
}

// R14.1: malformed decisions through raw HTTP (bad JSON, unknown fields,
// wrong types) are refused with 4xx and nothing is written.
func TestJoinRequestDecideRawHTTP(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		reqs := insertRequests(t, e.DB, w.pool, 1)
		const approvePath = "/api/compute/bettercompute.v1.JoinRequestService/ApproveJoinRequest"
		const rejectPath = "/api/compute/bettercompute.v1.JoinRequestService/RejectJoinRequest"
		ok := fmt.Sprintf(`{"tenantId":%q,"poolId":%q,"requestId":%q,"reason":"intake"`, w.root, w.pool.Id, reqs[0].ID)
		snap := settle(t, w, w.root, e.Admin, w.pool.Id)
		for _, c := range []struct{ name, path, body string }{
			{"unknown field", approvePath, ok + `,"ttlSeconds":900,"bogus":1}`},
			{"ttl as a string", approvePath, ok + `,"ttlSeconds":"soon"}`},
			{"ttl fractional", approvePath, ok + `,"ttlSeconds":900.5}`},
			{"truncated", approvePath, ok},
			{"not JSON", rejectPath, `reason=intake`},
			{"reason as a number", rejectPath, fmt.Sprintf(`{"tenantId":%q,"poolId":%q,"requestId":%q,"reason":7}`, w.root, w.pool.Id, reqs[0].ID)},
			{"unknown field on reject", rejectPath, ok + `,"ttlSeconds":900}`},
		} {
			t.Run(c.name, func(t *testing.T) {
				status, m := postTo(t, e, c.path, "application/json", e.AdminKey, strings.NewReader(c.body))
				if status != 400 || m["code"] != "invalid_argument" {
					t.Fatalf("status %d, answer %v", status, m)
				}
			})
		}
		snap.unchanged(t, w, w.root, e.Admin, w.pool.Id)
		// The well-formed call works.
		if status, m := postTo(t, e, approvePath, "application/json", e.AdminKey, strings.NewReader(ok+`,"ttlSeconds":900}`)); status != 200 || m["state"] != "approved" {
			t.Fatalf("valid approve: %d %v", status, m)
		}
	})
}
