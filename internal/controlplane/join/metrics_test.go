package join_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/secret"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// R17.1: an admitted join, a refused one and a renewal move the join,
// phase (each of check, admit, seal, attest, sign and commit), spend, issuance and renewal series by exactly one each, with the
// refusal's reason from the fixed set as its label.
func TestJoinMetricsR17_1(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{Metrics: apimetrics.NewAPI(reg)})
	f := newFixture(t, e)
	tok := f.token(t, nil)
	m := jointest.NewMachine(t, jointest.Claims(9001))
	j := f.mustJoin(t, m, tok.Token, pki.RoleNode)

	bad := jointest.NewMachine(t, jointest.Claims(9002))
	_, err := f.join(t, bad, unknownToken(), "")
	jointest.WantRefused(t, err)

	req, _ := jointest.RenewRequest(t, m.Key, j.Body.CertChain, j.Body.NodeId, time.Now())
	if _, err := f.svc.Renew(context.Background(), req, join.Peer{Addr: "192.0.2.7:40001", Cert: j.Leaf.Raw}); err != nil {
		t.Fatalf("renew: %v", err)
	}

	v := telemetrytest.Gather(t, reg)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{telemetry.Joins, []string{"attestor", "join-token", "role", pki.RoleNode, "outcome", "admitted"}, 1},
		{telemetry.Joins, []string{"outcome", "refused"}, 1},
		{telemetry.Joins, []string{"outcome", "refused", "reason", "token-unknown"}, 1},
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "check"}, 2},
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "admit"}, 2}, // the unknown token is refused by the attestor
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "seal"}, 2},
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "attest"}, 2},
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "sign"}, 1},   // only the admitted join is signed
		{telemetry.JoinPhaseSeconds + "_count", []string{"phase", "commit"}, 1}, // the refused join rolls back
		{telemetry.TokenSpends, nil, 1},
		{telemetry.CertificatesIssued, []string{"role", pki.RoleNode}, 2},
		{telemetry.Renewals, []string{"role", pki.RoleNode, "outcome", "admitted"}, 1},
	} {
		if got := v.Get(c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v (all: %v)", c.name, c.labels, got, c.want, v)
		}
	}
}

// unknownToken is a well-formed join token no one minted.
func unknownToken() string {
	plain, _ := secret.Mint()
	return secret.Format("bcjt", ids.New(ids.JoinToken, time.Now()), plain)
}

// R17.1: a deferred join is one deferral and one pending join request;
// its approval through the operator API is one decision, and the retry is
// one admitted discovery join; the pending gauge is counted at scrape
// time.
func TestApprovalMetricsR17_1(t *testing.T) {
	reg := prometheus.NewRegistry()
	opts := discoveryAttestors
	opts.Metrics = apimetrics.NewAPI(reg)
	e := apitest.Start(t, storetest.OpenSQLite(t), opts)
	e.Server.RegisterMetrics(reg)
	d := newDisco(t, e, tenancy.ApprovalAlways)
	d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
	m := ramdiskMachine(t, boot1.mac)
	req := d.request(t, m, d.ramdisk, boot1, time.Time{})
	df := d.mustDefer(t, d.svc, m, req)

	v := telemetrytest.Gather(t, reg)
	if got := v.Get(telemetry.Joins, "attestor", discovery.Name, "outcome", telemetry.OutcomeDeferred); got != 1 {
		t.Errorf("deferred joins %v, want 1", got)
	}
	if got := v.Get(telemetry.JoinRequests, "state", "pending"); got != 1 {
		t.Errorf("pending join requests %v, want 1", got)
	}
	if _, err := e.Admin.JoinRequests.ApproveJoinRequest(context.Background(), rq(&bcv1.ApproveJoinRequestRequest{
		TenantId: d.root, PoolId: d.pool.Id, RequestId: df.GetRequestId(), TtlSeconds: 900, Reason: "rack B7 intake"})); err != nil {
		t.Fatal(err)
	}
	if _, err := d.joinWith(d.svc, req); err != nil {
		t.Fatalf("join after the approval: %v", err)
	}
	v = telemetrytest.Gather(t, reg)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{telemetry.JoinRequestsDecided, []string{"decision", telemetry.DecisionApproved}, 1},
		{telemetry.Joins, []string{"attestor", discovery.Name, "outcome", telemetry.OutcomeAdmitted}, 1},
		{telemetry.TokenSpends, nil, 1},
	} {
		if got := v.Get(c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}
