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
