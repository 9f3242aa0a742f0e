package cli_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// mkRequests stores n pending join requests in the pool as JoinService
// would, the first with claims carrying terminal escapes, and returns
// their ids in order (each a millisecond apart, so ids sort as made).
func (w *world) mkRequests(t testing.TB, pool string, n int) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	base := time.Now()
	err := w.e.DB.WithTx(ctx, func(tx *store.Tx) error {
		p, err := tx.GetPool(ctx, pool)
		if err != nil {
			return err
		}
		for i := range n {
			claims := fmt.Sprintf(`{"productSerial":"SN-%d","hostname":"pxe-%d"}`, i, i)
			if i == 0 {
				claims = `{"productSerial":"SN-0","hostname":"evil\u001b]0;pwned\u0007\u001b[2J"}`
			}
			r, err := tx.InsertJoinRequest(ctx, store.JoinRequest{ID: ids.New(ids.JoinRequest, base.Add(time.Duration(i)*time.Millisecond)), TenantID: p.OwnerTenantID, PoolID: p.ID,
				SiteID: p.SiteID, Attestor: "discovery", Role: "ramdisk", MachineKey: fmt.Sprintf("mac:%d", i), Claims: []byte(claims),
				HardwareKey: []byte{0xbe, 0xef}, MAC: fmt.Sprintf("52:54:00:00:00:%02x", i%256), IP: "10.0.0.5", WorkflowID: "wf-1", VouchedBy: "node_site",
				BootLeaseEpoch: 3, CSRSHA256: []byte(fmt.Sprintf("%032d", i))})
			if err != nil {
				return err
			}
			out = append(out, r.ID)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (w *world) requestState(t testing.TB, id string) string {
	t.Helper()
	var r store.JoinRequest
	err := w.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		r, err = tx.GetJoinRequest(context.Background(), id)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return r.State
}

// R3.4, R3.6, R10.2: join-requests list shows a pool's pending requests in
// a table (claims escaped) or every field with --json; --state all shows
// decided ones; every page is read.
func TestJoinRequestsListR3_4(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		reqs := w.mkRequests(t, w.pool, 205)
		r := w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool).ok(t)
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		if len(lines) != 206 || !strings.HasPrefix(lines[0], "ID ") || !strings.Contains(lines[0], "EVIDENCE") || !strings.Contains(lines[0], "CLAIMS") {
			t.Fatalf("table of %d lines:\n%s", len(lines), strings.Join(lines[:3], "\n"))
		}
		if strings.ContainsAny(r.stdout, "\x1b\x07") || !strings.Contains(lines[1], reqs[0]) || !strings.Contains(lines[1], `\u001b`) {
			t.Fatalf("first row not escaped: %q", lines[1])
		}
		var l bcv1.ListJoinRequestsResponse
		w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &l)
		if len(l.Items) != 205 {
			t.Fatalf("%d requests in JSON", len(l.Items))
		}
		x := l.Items[1]
		if x.Id != reqs[1] || x.State != "pending" || x.Attestor != "discovery" || x.HardwareKey != "beef" || x.Mac != "52:54:00:00:00:01" || x.Ip != "10.0.0.5" ||
			x.WorkflowId != "wf-1" || x.VouchedBy != "node_site" || x.BootLeaseEpoch != 3 || len(x.CsrSha256) != 64 || x.Claims.AsMap()["hostname"] != "pxe-1" {
			t.Fatalf("request %v", x)
		}
		w.cli(t, "join-requests", "reject", reqs[0], "--tenant", w.root, "--pool", w.pool, "--reason", "unknown serial").ok(t)
		w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool, "--json").ok(t).decode(t, &l)
		if len(l.Items) != 204 {
			t.Fatalf("%d pending after a rejection", len(l.Items))
		}
		w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool, "--state", "all", "--json").ok(t).decode(t, &l)
		if len(l.Items) != 205 || l.Items[0].State != "rejected" {
			t.Fatalf("all: %d, first %v", len(l.Items), l.Items[0])
		}
		w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool, "--state", "rejected,consumed", "--json").ok(t).decode(t, &l)
		if len(l.Items) != 1 || l.Items[0].Id != reqs[0] {
			t.Fatalf("rejected: %v", l.Items)
		}
		w.cli(t, "join-requests", "list", "--tenant", w.root, "--pool", w.pool, "--state", "bogus").fails(t, "INVALID_ARGUMENT", "state")
		w.cli(t, "join-requests", "list", "--tenant", w.root).fails(t, "INVALID_ARGUMENT", "--pool")
		w.cli(t, "join-requests", "list", "--tenant", w.acme, "--pool", w.pool).fails(t, "NOT_FOUND")
	})
}

// R3.4, R10.3: approve --ttl in seconds (60 to 86400) and reject, each with
// a reason; what is refused locally sends nothing; deciding twice is
// INVALID_STATE.
func TestJoinRequestsDecideR3_4(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		reqs := w.mkRequests(t, w.pool, 3)
		base := []string{"--tenant", w.root, "--pool", w.pool}
		approve := func(args ...string) result {
			return w.cli(t, append(append([]string{"join-requests", "approve"}, args...), base...)...)
		}
		for _, ttl := range []string{"59", "86401", "15m", "-900", ""} {
			approve(reqs[0], "--ttl", ttl, "--reason", "intake").fails(t, "INVALID_ARGUMENT", "--ttl")
		}
		approve(reqs[0], "--ttl", "900").fails(t, "INVALID_ARGUMENT", "--reason")
		approve(reqs[0], "--ttl", "900", "--reason", "  ").fails(t, "INVALID_ARGUMENT", "--reason")
		approve("jt_01k5w0000000000000000000zz", "--ttl", "900", "--reason", "x").fails(t, "INVALID_ARGUMENT", "jreq_")
		approve("bcjt_jt_01k5w0000000000000000000zz.secret", "--ttl", "900", "--reason", "x").fails(t, "INVALID_ARGUMENT", "nothing was sent")
		if s := w.requestState(t, reqs[0]); s != "pending" {
			t.Fatalf("state %s after refused approvals", s)
		}

		r := approve(reqs[0], "--ttl", "60", "--reason", "rack B7 intake, ticket 4411").ok(t)
		for _, want := range []string{"approved", "rack B7 intake, ticket 4411", "beef", "node_site", "approved until"} {
			if !strings.Contains(r.stdout, want) {
				t.Fatalf("approve output lacks %q:\n%s", want, r.stdout)
			}
		}
		var got bcv1.JoinRequest
		approve(reqs[1], "--ttl", "86400", "--reason", "a day", "--json").ok(t).decode(t, &got)
		if got.State != "approved" || got.ApprovedUntil.AsTime().Sub(got.DecidedAt.AsTime()) != 24*time.Hour {
			t.Fatalf("approved %v", &got)
		}
		approve(reqs[0], "--ttl", "900", "--reason", "again").fails(t, "INVALID_STATE")
		w.cli(t, append([]string{"join-requests", "reject", reqs[0], "--reason", "again"}, base...)...).fails(t, "INVALID_STATE")
		w.cli(t, append([]string{"join-requests", "reject", reqs[2]}, base...)...).fails(t, "INVALID_ARGUMENT", "--reason")
		w.cli(t, append([]string{"join-requests", "reject", reqs[2], "--reason", "unknown serial", "--json"}, base...)...).ok(t).decode(t, &got)
		if got.State != "rejected" || got.Reason != "unknown serial" {
			t.Fatalf("rejected %v", &got)
		}
		// Another tenant's key: NOT_FOUND, and nothing decided.
		run(t, w.as(w.acmeKey), "join-requests", "approve", reqs[2], "--tenant", w.acme, "--pool", w.acmePool, "--ttl", "900", "--reason", "x").fails(t, "NOT_FOUND")
	})
}

// R3.4, R3.6: --help explains the commands and their bounds.
func TestJoinRequestsHelp(t *testing.T) {
	for _, c := range []struct {
		args []string
		want []string
	}{
		{[]string{"join-requests", "--help"}, []string{"list", "approve", "reject", "vouched"}},
		{[]string{"join-requests", "list", "--help"}, []string{"--state", "all", "expired"}},
		{[]string{"join-requests", "approve", "--help"}, []string{"--ttl", "60 to 86400", "--reason", "exactly one join"}},
		{[]string{"join-requests", "reject", "--help"}, []string{"--reason", "fails"}},
	} {
		r := run(t, nil, c.args...).ok(t)
		for _, w := range c.want {
			if !strings.Contains(r.stdout, w) {
				t.Fatalf("%v lacks %q:\n%s", c.args, w, r.stdout)
			}
		}
	}
}

// R22.1, R22.2: two tpm requests with the same claims show apart in the
// table and in --json by their EK, each naming the other; a request that
// reclaims a node names it in list and show, and approve refuses it
// locally without --reclaim, at the server with a stale --version
// (CONFLICT), and admits it acknowledged.
func TestJoinRequestsEvidenceAndReclaimR22(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		claims := []byte(`{"productUuid":"4c4c4544-0042-3510-8052-b7c04f000001","productSerial":"SN-7","macs":["00:1b:21:00:00:07"]}`)
		var reqs []string
		var victim string
		err := w.e.DB.WithTx(ctx, func(tx *store.Tx) error {
			p, err := tx.GetPool(ctx, w.pool)
			if err != nil {
				return err
			}
			n, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, time.Now()), TenantID: p.OwnerTenantID, SiteID: p.SiteID, PoolID: p.ID,
				Role: "node", State: store.NodeAdopted, Connection: "disconnected", IdentityGeneration: 1, HardwareKey: []byte{0x77}, HardwareKeyTrusted: true,
				NodeKey: "unattested", Attestor: "join-token", Hostname: "db-7", Claims: claims})
			if err != nil {
				return err
			}
			victim = n.ID
			for i, ek := range []byte{0xe1, 0xe2, 0xe3} {
				r := store.JoinRequest{ID: ids.New(ids.JoinRequest, time.Now().Add(time.Duration(i)*time.Millisecond)), TenantID: p.OwnerTenantID, PoolID: p.ID,
					SiteID: p.SiteID, Attestor: "tpm", Role: "node", MachineKey: fmt.Sprintf("ek:%x", ek), Claims: claims, HardwareKey: []byte{0x77},
					EKHash: bytes.Repeat([]byte{ek}, 32), EKCert: store.EKCertUntrusted, EKCertSubject: "CN=swtpm", EKCertIssuer: fmt.Sprintf("CN=swtpm-localca-%d", i),
					AKName: []byte{0, 0xb, ek}, CSRSHA256: bytes.Repeat([]byte{ek}, 32), Source: "192.0.2.9", Effect: store.JoinEffectNew}
				if i == 2 {
					r.MachineKey, r.HardwareKey, r.Effect, r.EffectNodeID = "ek:other", []byte{0x78}, store.JoinEffectReclaim, victim
				}
				if r, err = tx.InsertJoinRequest(ctx, r); err != nil {
					return err
				}
				reqs = append(reqs, r.ID)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		base := []string{"--tenant", w.root, "--pool", w.pool}
		out := w.cli(t, append([]string{"join-requests", "list"}, base...)...).ok(t).stdout
		for _, want := range []string{"EVIDENCE", "EFFECT", "ek e1e1e1e1e1e1e1e1…, ek cert untrusted, peer 192.0.2.9", "ek e2e2e2e2e2e2e2e2…",
			"new node; SAME CLAIMS as " + reqs[1], "new node; SAME CLAIMS as " + reqs[0], "RECLAIM " + victim + " (node, gen 1"} {
			if !strings.Contains(out, want) {
				t.Errorf("list lacks %q:\n%s", want, out)
			}
		}
		var l bcv1.ListJoinRequestsResponse
		w.cli(t, append([]string{"join-requests", "list", "--json"}, base...)...).ok(t).decode(t, &l)
		if len(l.Items) != 3 || l.Items[0].Evidence.GetEkSha256() == l.Items[1].Evidence.GetEkSha256() || l.Items[0].HardwareKey != l.Items[1].HardwareKey ||
			l.Items[0].Evidence.GetEkCertificateIssuer() == l.Items[1].Evidence.GetEkCertificateIssuer() || l.Items[0].Version == "" {
			t.Fatalf("--json: %v", l.Items)
		}
		show := w.cli(t, append([]string{"join-requests", "show", reqs[2]}, base...)...).ok(t).stdout
		for _, want := range []string{"RECLAIM " + victim, "node: serials", "SN-7", "00:1b:21:00:00:07", "db-7", "untrusted (chains to no manufacturer CA", "CN=swtpm-localca-2"} {
			if !strings.Contains(show, want) {
				t.Errorf("show lacks %q:\n%s", want, show)
			}
		}
		approve := func(args ...string) result {
			return w.cli(t, append(append([]string{"join-requests", "approve"}, args...), base...)...)
		}
		approve(reqs[2], "--ttl", "900", "--reason", "disk replaced").fails(t, "INVALID_STATE", "--reclaim "+victim)
		approve(reqs[2], "--ttl", "900", "--reason", "disk replaced", "--reclaim", "node_x").fails(t, "INVALID_ARGUMENT", "--reclaim")
		approve(reqs[2], "--ttl", "900", "--reason", "disk replaced", "--reclaim", victim, "--version", l.Items[0].Version).fails(t, "CONFLICT", "changed since it was listed")
		if s := w.requestState(t, reqs[2]); s != "pending" {
			t.Fatalf("state %s after refused approvals", s)
		}
		var got bcv1.JoinRequest
		approve(reqs[2], "--ttl", "900", "--reason", "disk replaced", "--reclaim", victim, "--json").ok(t).decode(t, &got)
		if got.State != "approved" || got.AcknowledgedReclaimNodeId != victim {
			t.Fatalf("approved %v", &got)
		}
		approve(reqs[0], "--ttl", "900", "--reason", "EK checked", "--version", l.Items[0].Version).ok(t)
	})
}
