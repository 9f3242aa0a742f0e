package enroll

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R10.1: a signed deferral makes bcd print the request id, wait as told and
// send the very same request again until it is admitted.
func TestJoinWaitsOnDeferral(t *testing.T) {
	e := newEnv(t, envOption{})
	e.fake.DeferNext(3, false, nil)
	id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	if id.NodeID == "" || e.fake.Calls() != 4 {
		t.Fatalf("joined %+v after %d calls, want 4", id, e.fake.Calls())
	}
	reqs := e.fake.Requests()
	for _, r := range reqs[1:] {
		if string(pki.JoinRequestDigest(r)) != string(pki.JoinRequestDigest(reqs[0])) {
			t.Fatal("a retry after a deferral is another request: an approval admits the CSR it was given for")
		}
	}
	if len(e.sleeps) != 3 || e.sleeps[0] != 7*time.Second {
		t.Errorf("waits %v, want the deferral's 7s three times", e.sleeps)
	}
	said := strings.Join(e.progress, "\n")
	if strings.Count(said, enrolltest.DeferredRequest+" is waiting for approval") != 1 {
		t.Errorf("progress %q: want the request id said once", said)
	}
}

// R10.3: a request rejected while bcd waited fails the join with a message
// naming it; join.pending goes (the request did not land).
func TestJoinRejectedWhileWaiting(t *testing.T) {
	e := newEnv(t, envOption{})
	e.fake.DeferNext(2, true, nil)
	_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	if errs.CodeOf(err) != errs.AccessDenied || !strings.Contains(err.Error(), enrolltest.DeferredRequest) || !strings.Contains(err.Error(), "rejected") {
		t.Fatalf("join: %v, want ACCESS_DENIED naming the rejected request", err)
	}
	if _, err := e.store.Load(); err == nil {
		t.Fatal("an identity was saved")
	}
}

// R10.1: bcd keeps waiting across runs: the request (key and CSR) is kept
// in join.pending while it waits, and a bcd join after an interruption
// sends the same one.
func TestJoinWaitSurvivesRestart(t *testing.T) {
	e := newEnv(t, envOption{})
	e.fake.DeferNext(1, false, nil)
	j := e.joiner(e.cfg)
	j.sleep = func(context.Context, time.Duration) error { return context.Canceled } // Ctrl-C while waiting
	_, err := j.Join(context.Background(), e.opts())
	if errs.CodeOf(err) != errs.Unavailable || !strings.Contains(err.Error(), enrolltest.DeferredRequest) {
		t.Fatalf("interrupted join: %v", err)
	}
	first := e.fake.LastRequest()
	if _, err := e.joiner(e.cfg).Join(context.Background(), e.opts()); err != nil {
		t.Fatalf("the next bcd join: %v", err)
	}
	if string(pki.JoinRequestDigest(e.fake.LastRequest())) != string(pki.JoinRequestDigest(first)) {
		t.Fatal("after the restart bcd sent another request")
	}
}

// R10.1, R4.6: a deferral is checked like any answer; a forged or
// misdirected one fails the join and saves nothing.
func TestDeferralChecks(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(b *agentv1.JoinResponseBody)
	}{
		{"another CSR", func(b *agentv1.JoinResponseBody) { b.CsrSha256 = make([]byte, 32) }},
		{"another site", func(b *agentv1.JoinResponseBody) { b.SiteId = "site_01k5w0000000000000000other" }},
		{"another role", func(b *agentv1.JoinResponseBody) { b.Role = pki.RoleSite }},
		{"no request id", func(b *agentv1.JoinResponseBody) { b.Deferral.RequestId = "" }},
		{"a certificate too", func(b *agentv1.JoinResponseBody) { b.NodeId = "node_01k5w000000000000000000001" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.fake.DeferNext(1, false, tc.mod)
			_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
			if errs.CodeOf(err) != errs.Unauthenticated {
				t.Fatalf("join: %v, want the answer refused", err)
			}
			if _, err := e.store.Load(); err == nil {
				t.Fatal("an identity was saved")
			}
		})
	}
	// A renewal's answer may never defer.
	body, _ := proto.Marshal(&agentv1.JoinResponseBody{Deferral: &agentv1.JoinDeferral{RequestId: enrolltest.DeferredRequest}})
	e := newEnv(t, envOption{})
	sig, _ := pki.SignResponse(e.bundle.JoinSigningKey, body)
	if _, err := verifySigned(body, sig, e.bundle.JoinSigningCert.Raw, expectation{signingPins: []string{e.pins.JoinSigning}, renewal: true}); err == nil {
		t.Fatal("a renewal answer that defers was accepted")
	}
}

// R10.4: the discovery attestor's evidence from the flags.
func TestDiscoveryOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts Options
		ok   bool
	}{
		{"ramdisk with its boot", Options{Token: "t", Attestor: "discovery", Role: "ramdisk", Boot: &Boot{MAC: "00:1b:21:0a:0b:0c", IP: "10.0.0.7", LeaseEpoch: 1}}, true},
		{"not a ramdisk", Options{Token: "t", Attestor: "discovery", Boot: &Boot{MAC: "00:1b:21:0a:0b:0c", IP: "10.0.0.7", LeaseEpoch: 1}}, false},
		{"no boot", Options{Token: "t", Attestor: "discovery", Role: "ramdisk"}, false},
		{"a boot without discovery", Options{Token: "t", Boot: &Boot{MAC: "00:1b:21:0a:0b:0c", IP: "10.0.0.7", LeaseEpoch: 1}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := checkOptions(tc.opts); (err == nil) != tc.ok {
				t.Fatalf("checkOptions: %v, want ok %v", err, tc.ok)
			}
		})
	}
	for _, b := range []*Boot{
		{MAC: "52:54:00:12:34:56", IP: "10.0.0.7", LeaseEpoch: 1}, // locally administered
		{MAC: "00:1b:21:0a:0b:0c", IP: "ten", LeaseEpoch: 1},
		{MAC: "00:1b:21:0a:0b:0c", IP: "10.0.0.7", LeaseEpoch: 0},
	} {
		if _, err := bootEvidence(b); errs.CodeOf(err) != errs.InvalidArgument {
			t.Errorf("bootEvidence(%+v): %v, want INVALID_ARGUMENT", b, err)
		}
	}
}
