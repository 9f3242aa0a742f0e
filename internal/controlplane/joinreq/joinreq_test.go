package joinreq

import (
	"slices"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R10.3: an approval that ran out shows as expired, on read.
func TestState(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	at := func(d time.Duration) *time.Time { x := now.Add(d); return &x }
	for _, tc := range []struct {
		name  string
		r     store.JoinRequest
		state string
	}{
		{"pending", store.JoinRequest{State: store.JoinRequestPending}, "pending"},
		{"approved, running", store.JoinRequest{State: store.JoinRequestApproved, ApprovedUntil: at(time.Millisecond)}, "approved"},
		{"approved, ends now", store.JoinRequest{State: store.JoinRequestApproved, ApprovedUntil: at(0)}, "expired"},
		{"approved, ran out", store.JoinRequest{State: store.JoinRequestApproved, ApprovedUntil: at(-time.Hour)}, "expired"},
		{"consumed after its end", store.JoinRequest{State: store.JoinRequestConsumed, ApprovedUntil: at(-time.Hour)}, "consumed"},
		{"stored expired", store.JoinRequest{State: store.JoinRequestExpired, ApprovedUntil: at(-time.Hour)}, "expired"},
	} {
		if got := State(tc.r, now); got != tc.state {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.state)
		}
	}
}

// R10.2: the states asked for map to the stored states read.
func TestListStates(t *testing.T) {
	for _, tc := range []struct {
		asked, stored []string
		all           bool
		bad           bool
	}{
		{asked: nil, stored: []string{"pending"}},
		{asked: []string{"all"}, all: true},
		{asked: []string{"expired"}, stored: []string{"approved", "expired"}},
		{asked: []string{"rejected", "pending", "rejected"}, stored: []string{"pending", "rejected"}},
		{asked: []string{"all", "pending"}, bad: true},
		{asked: []string{"live"}, bad: true},
		{asked: []string{"pending", "pending", "pending", "pending", "pending", "pending"}, bad: true},
	} {
		stored, keep, err := listStates(tc.asked)
		switch {
		case tc.bad:
			if e, ok := errs.As(err); !ok || e.Code != errs.InvalidArgument || e.Field != "state" {
				t.Errorf("%v: %v, want INVALID_ARGUMENT on state", tc.asked, err)
			}
		case err != nil:
			t.Errorf("%v: %v", tc.asked, err)
		case tc.all && (stored != nil || keep != nil):
			t.Errorf("all: %v %v, want every state", stored, keep)
		case !tc.all && !slices.Equal(stored, tc.stored):
			t.Errorf("%v: read %v, want %v", tc.asked, stored, tc.stored)
		}
	}
}

// R10.3: event data carries the decision's TTL in seconds.
func TestPublished(t *testing.T) {
	at := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	until := at.Add(900 * time.Second)
	d := Published(store.JoinRequest{ID: "jreq_x", HardwareKey: []byte{0xab}, CSRSHA256: []byte{0x01, 0x02}, DecidedAt: &at, ApprovedUntil: &until,
		Reason: "intake", DecidedBy: "prn_a"})
	if d["ttlSeconds"] != int64(900) || d["hardwareKey"] != "ab" || d["csrSha256"] != "0102" || d["reason"] != "intake" || d["decidedBy"] != "prn_a" {
		t.Fatalf("data %v", d)
	}
	if d := Published(store.JoinRequest{ID: "jreq_y"}); d["ttlSeconds"] != int64(0) || d["hardwareKey"] != "" {
		t.Fatalf("undecided data %v", d)
	}
}

// R22.2: a request's version changes with everything a refresh may change
// (CSR, claims, evidence, effect) and with nothing a decision changes.
func TestVersion(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	base := store.JoinRequest{ID: "jreq_1", PoolID: "pool_1", Attestor: "tpm", Role: "node", Claims: []byte(`{"productSerial":"SN-1"}`),
		HardwareKey: []byte{1}, EKHash: []byte{2}, EKCert: store.EKCertUntrusted, EKCertSubject: "CN=ek", EKCertIssuer: "CN=ca", AKName: []byte{3},
		MAC: "52:54:00:00:00:01", IP: "10.0.0.1", WorkflowID: "wf", VouchedBy: "node_a", BootLeaseEpoch: 1, CSRSHA256: []byte{4}, Source: "10.0.0.1",
		Effect: store.JoinEffectNew, State: store.JoinRequestPending}
	v := Version(base)
	for _, tc := range []struct {
		name    string
		edit    func(r *store.JoinRequest)
		changes bool
	}{
		{"csr", func(r *store.JoinRequest) { r.CSRSHA256 = []byte{5} }, true},
		{"claims", func(r *store.JoinRequest) { r.Claims = []byte(`{"productSerial":"SN-2"}`) }, true},
		{"ek", func(r *store.JoinRequest) { r.EKHash = []byte{6} }, true},
		{"ek certificate", func(r *store.JoinRequest) { r.EKCert = store.EKCertAbsent }, true},
		{"ak", func(r *store.JoinRequest) { r.AKName = []byte{7} }, true},
		{"vouch", func(r *store.JoinRequest) { r.BootLeaseEpoch = 2 }, true},
		{"peer", func(r *store.JoinRequest) { r.Source = "10.0.0.2" }, true},
		{"effect", func(r *store.JoinRequest) { r.Effect, r.EffectNodeID = store.JoinEffectReclaim, "node_1" }, true},
		{"field boundary", func(r *store.JoinRequest) { r.MAC, r.IP = r.MAC+"1", r.IP[1:] }, true},
		{"decision", func(r *store.JoinRequest) {
			r.State, r.DecidedAt, r.DecidedBy, r.Reason, r.ApprovedUntil, r.AcknowledgedNodeID = store.JoinRequestApproved, &now, "prn", "ok", &now, "node_1"
		}, false},
		{"times", func(r *store.JoinRequest) { r.UpdatedAt = now }, false},
	} {
		r := base
		tc.edit(&r)
		if got := Version(r) != v; got != tc.changes {
			t.Errorf("%s: version changed %v, want %v", tc.name, got, tc.changes)
		}
	}
}

// R22.2: an approval names the version it reviewed, and a reclaim needs
// its node acknowledged.
func TestCheckApproval(t *testing.T) {
	newNode := store.JoinRequest{ID: "jreq_1", Effect: store.JoinEffectNew, CSRSHA256: []byte{1}}
	reclaim := store.JoinRequest{ID: "jreq_2", Effect: store.JoinEffectReclaim, EffectNodeID: "node_v", CSRSHA256: []byte{1}}
	for _, tc := range []struct {
		name string
		r    store.JoinRequest
		a    Approval
		code errs.Code
	}{
		{"new node, bare", newNode, Approval{}, ""},
		{"new node, version", newNode, Approval{Version: Version(newNode)}, ""},
		{"new node, stale", newNode, Approval{Version: Version(reclaim)}, errs.Conflict},
		{"new node, acknowledged", newNode, Approval{AcknowledgeReclaimNodeID: "node_v"}, errs.InvalidState},
		{"reclaim, bare", reclaim, Approval{}, errs.InvalidState},
		{"reclaim, version only", reclaim, Approval{Version: Version(reclaim)}, errs.InvalidState},
		{"reclaim, acknowledged only", reclaim, Approval{AcknowledgeReclaimNodeID: "node_v"}, errs.InvalidState},
		{"reclaim, another node", reclaim, Approval{Version: Version(reclaim), AcknowledgeReclaimNodeID: "node_w"}, errs.InvalidState},
		{"reclaim, stale", reclaim, Approval{Version: Version(newNode), AcknowledgeReclaimNodeID: "node_v"}, errs.Conflict},
		{"reclaim, acknowledged", reclaim, Approval{Version: Version(reclaim), AcknowledgeReclaimNodeID: "node_v"}, ""},
	} {
		err := checkApproval(tc.r, tc.a)
		if got := errs.CodeOf(err); tc.code == "" && err != nil || tc.code != "" && got != tc.code {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.code)
		}
	}
}
