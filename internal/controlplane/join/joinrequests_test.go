package join_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/joinreq"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Join requests and the discovery attestor (R10.1–R10.4): a ramdisk joins
// with its site's ramdisk token and the boot a site agent vouched for; the
// pool's approval mode decides whether it waits for a person.

var discoveryAttestors = apitest.Options{Attestors: []string{jointoken.Name, discovery.Name}}

// disco is a fixture with a pool for ramdisks (approval mode as given), a
// ramdisk token for it minted the way modules do (R2.7), and a site agent
// node id for vouches.
type disco struct {
	*fixture
	pool    *bcv1.Pool
	ramdisk string // bearer token
	tokenID string
	agent   string // the vouching site agent's node id
}

func newDisco(t testing.TB, e *apitest.Env, approval string) *disco {
	t.Helper()
	return newDiscoIn(t, newFixture(t, e), approval)
}

// newDiscoIn is newDisco in an existing fixture (a pool of its own).
func newDiscoIn(t testing.TB, f *fixture, approval string) *disco {
	t.Helper()
	d := &disco{fixture: f, agent: "node_01k5w00000000000000000site"}
	d.pool = mkPool(t, f.e.Admin, f.root, f.site.Id, "ramdisks-"+approval, &bcv1.PoolPolicy{Discovery: &bcv1.DiscoveryPolicy{Approval: approval}})
	d.ramdisk, d.tokenID = mintRamdisk(t, f.e, f.root, d.pool.Id, 1000)
	return d
}

// mintRamdisk mints a ramdisk token through tokens.MintInternal into a
// file sink and reads the bearer back from the reference (R2.7).
func mintRamdisk(t testing.TB, e *apitest.Env, tenant, pool string, uses int) (bearer, id string) {
	t.Helper()
	svc := tokens.New(tokens.Config{DB: e.DB, Hub: e.Server.Hub()})
	tok, ref, err := svc.MintInternal(context.Background(), tokens.FileSink{Dir: t.TempDir()}, tokens.InternalRequest{
		Module: "test-site", TenantID: tenant, PoolID: pool, Role: tokens.RoleRamdisk, TTL: time.Hour, MaxUses: uses, SecretName: "ramdisk.token"})
	if err != nil {
		t.Fatal(err)
	}
	path, ok := strings.CutPrefix(ref, "file:")
	if !ok {
		t.Fatalf("reference %q is not a file reference", ref)
	}
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("secret file %s: %v, mode %v; want 0600", path, err, st.Mode())
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(raw)), tok.ID
}

func (d *disco) vouch(t testing.TB, siteID, mac, ip string, epoch int64) {
	t.Helper()
	err := d.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		_, err := tx.UpsertSiteVouch(context.Background(), store.SiteVouch{TenantID: d.root, SiteID: siteID, MAC: mac, IP: ip, LeaseEpoch: epoch, VouchedBy: d.agent})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ramdiskMachine is a network-booted machine with one NIC and nothing
// else to identify it: an untrusted hardware key, keyed by site and MAC.
func ramdiskMachine(t testing.TB, mac string) *jointest.Machine {
	return jointest.NewMachine(t, &agentv1.Claims{Macs: []string{mac}, Hostname: "ramdisk"})
}

type boot struct {
	mac, ip string
	epoch   int64
}

// request is m's discovery join for boot b, sealed with token at at (the
// zero time: now).
func (d *disco) request(t testing.TB, m *jointest.Machine, token string, b boot, at time.Time) *agentv1.JoinRequest {
	t.Helper()
	ev, err := proto.Marshal(&agentv1.DiscoveryEvidence{Mac: b.mac, Ip: b.ip, BootLeaseEpoch: b.epoch})
	if err != nil {
		t.Fatal(err)
	}
	req := &agentv1.JoinRequest{Csr: m.CSR, Claims: proto.Clone(m.Claims).(*agentv1.Claims), Attestor: discovery.Name, Role: pki.RoleRamdisk, Protocol: 2, Evidence: ev}
	if at.IsZero() {
		at = time.Now()
	}
	req.SealedToken = jointest.SealAt(t, d.e.Bundle, token, req, at)
	return req
}

// joinWith sends req as an honest ramdisk does: from its boot address, as
// the gateway saw it (R10.4).
func (d *disco) joinWith(svc *join.Service, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	return d.joinFrom(svc, req, bootPeer(req, "192.0.2.9:40000"))
}

// joinFrom sends req as if the gateway saw it come from peer.
func (d *disco) joinFrom(svc *join.Service, req *agentv1.JoinRequest, peer string) (*agentv1.JoinResponse, error) {
	return svc.Join(context.Background(), req, join.Peer{Addr: peer})
}

// bootPeer is the address the gateway sees an honest ramdisk connect from,
// its boot IP; fallback for a request that is not a discovery join.
func bootPeer(req *agentv1.JoinRequest, fallback string) string {
	var ev agentv1.DiscoveryEvidence
	if req.GetAttestor() != discovery.Name || proto.Unmarshal(req.GetEvidence(), &ev) != nil || ev.GetIp() == "" {
		return fallback
	}
	return net.JoinHostPort(ev.GetIp(), "40000")
}

func (d *disco) requestRow(t testing.TB, id string) store.JoinRequest {
	t.Helper()
	var r store.JoinRequest
	d.read(t, func(tx *store.Tx) (err error) { r, err = tx.GetJoinRequest(context.Background(), id); return })
	return r
}

func (d *disco) requests(t testing.TB) []store.JoinRequest {
	t.Helper()
	var out []store.JoinRequest
	d.read(t, func(tx *store.Tx) (err error) {
		out, err = tx.ListJoinRequests(context.Background(), d.root, d.pool.Id, nil, "", 1000)
		return
	})
	return out
}

// getRequest reads a join request.
func (d *disco) getRequest(t testing.TB, id string) store.JoinRequest {
	t.Helper()
	var r store.JoinRequest
	err := d.e.DB.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
		r, err = tx.GetJoinRequest(context.Background(), id)
		return
	})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// approveUnacknowledged approves a request without acknowledging the node
// it reclaims, as the operator API never does (R22.2).
func (d *disco) approveUnacknowledged(t testing.TB, id string) {
	t.Helper()
	err := d.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		until := time.Now().Add(15 * time.Minute)
		_, err := tx.DecideJoinRequest(context.Background(), id, store.JoinRequestApproved, "key_test", "unreviewed", "", time.Now(), &until)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// reset puts a decided request back to pending, as a refresh does.
func (d *disco) reset(t testing.TB, id string) {
	t.Helper()
	err := d.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		r, err := tx.GetJoinRequest(context.Background(), id)
		if err != nil {
			return err
		}
		_, err = tx.RefreshJoinRequest(context.Background(), r)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// decide approves (ttl > 0) or rejects a pending request as an operator
// would, at the wall clock; an approval acknowledges the node the request
// reclaims, as an operator does after reviewing it (R22.2).
func (d *disco) decide(t testing.TB, id string, ttl time.Duration, at time.Time) {
	t.Helper()
	err := d.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		if ttl > 0 {
			r, err := tx.GetJoinRequest(context.Background(), id)
			if err != nil {
				return err
			}
			until := at.Add(ttl)
			_, err = tx.DecideJoinRequest(context.Background(), id, store.JoinRequestApproved, "key_test", "rack B7 intake", r.EffectNodeID, at, &until)
			return err
		}
		_, err := tx.DecideJoinRequest(context.Background(), id, store.JoinRequestRejected, "key_test", "unknown serial", "", at, nil)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (d *disco) mustDefer(t testing.TB, svc *join.Service, m *jointest.Machine, req *agentv1.JoinRequest) *agentv1.JoinDeferral {
	t.Helper()
	res, err := d.joinWith(svc, req)
	if err != nil {
		t.Fatalf("join: %v, want a deferral", err)
	}
	df := m.Deferral(t, d.e.Bundle, res)
	if !ids.Valid(ids.JoinRequest, df.GetRequestId()) || df.GetRetryAfterSeconds() <= 0 {
		t.Fatalf("deferral %v: want a jreq_ id and a wait", df)
	}
	return df
}

var boot1 = boot{mac: "00:1b:21:12:34:56", ip: "10.0.0.7", epoch: 3}

// R10.1, R10.2, R10.3: a deferred join records one request per machine,
// spends and issues nothing, is refreshed by a newer attempt, and an
// approval admits exactly that CSR once.
func TestJoinRequestLifecycle(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalUnknownMachines)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		m := ramdiskMachine(t, boot1.mac)
		req := d.request(t, m, d.ramdisk, boot1, time.Time{})

		// R10.1: deferred, nothing issued, no token spent.
		df := d.mustDefer(t, d.svc, m, req)
		if n := len(d.nodes(t, d.root)); n != 0 {
			t.Fatalf("%d nodes after a deferral, want 0", n)
		}
		if left := d.usesLeft(t, d.tokenID); left != 1000 {
			t.Fatalf("uses left %d after a deferral, want 1000", left)
		}
		r := d.requestRow(t, df.GetRequestId())
		if r.State != store.JoinRequestPending || r.MAC != boot1.mac || r.IP != boot1.ip || r.BootLeaseEpoch != boot1.epoch ||
			r.VouchedBy != d.agent || r.Attestor != discovery.Name || r.Role != pki.RoleRamdisk || r.PoolID != d.pool.Id ||
			string(r.CSRSHA256) != string(pki.CSRHash(m.CSR)) || !strings.Contains(string(r.Claims), boot1.mac) {
			t.Fatalf("request row %+v does not record what the attestor saw", r)
		}

		// The same request again waits on the same request, quietly.
		if again := d.mustDefer(t, d.svc, m, d.request(t, m, d.ramdisk, boot1, time.Time{})); again.GetRequestId() != df.GetRequestId() {
			t.Fatalf("the same attempt made request %s, want %s", again.GetRequestId(), df.GetRequestId())
		}
		// R15.4: a newer attempt (a new key and CSR) within the refresh
		// interval waits on the request as it is and writes nothing.
		m2 := ramdiskMachine(t, boot1.mac)
		if again := d.mustDefer(t, d.svc, m2, d.request(t, m2, d.ramdisk, boot1, time.Time{})); again.GetRequestId() != df.GetRequestId() {
			t.Fatalf("a newer attempt made request %s, want the machine's one request %s", again.GetRequestId(), df.GetRequestId())
		}
		if rs := d.requests(t); len(rs) != 1 || string(rs[0].CSRSHA256) != string(pki.CSRHash(m.CSR)) {
			t.Fatalf("requests %+v: want one, not yet refreshed", rs)
		}
		// R10.2: past it, the newer attempt refreshes it.
		if err := e.DB.SetClockOffset(context.Background(), join.DefaultRefreshInterval+time.Second); err != nil {
			t.Fatal(err)
		}
		if again := d.mustDefer(t, d.svc, m2, d.request(t, m2, d.ramdisk, boot1, time.Time{})); again.GetRequestId() != df.GetRequestId() {
			t.Fatalf("a newer attempt made request %s, want the machine's one request %s", again.GetRequestId(), df.GetRequestId())
		}
		if rs := d.requests(t); len(rs) != 1 || string(rs[0].CSRSHA256) != string(pki.CSRHash(m2.CSR)) {
			t.Fatalf("requests %+v: want one, refreshed with the newer CSR", rs)
		}
		if got := d.events(t, d.root, "security.join-request."); len(got) != 2 || got[0].Type != "security.join-request.created" || got[1].Type != "security.join-request.refreshed" {
			t.Fatalf("events %+v: want created then refreshed", got)
		}
		if len(d.audit(t, d.root, "join-request.created")) != 1 || len(d.audit(t, d.root, "join-request.refreshed")) != 1 {
			t.Error("want one audit row for the creation and one for the refresh")
		}

		// R10.3: approved; the retry with that CSR joins and consumes it.
		d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())
		final := d.request(t, m2, d.ramdisk, boot1, time.Time{})
		res, err := d.joinWith(d.svc, final)
		if err != nil {
			t.Fatalf("the approved join: %v", err)
		}
		got := m2.Verify(t, e.Bundle, res, pki.RoleRamdisk)
		if left := d.usesLeft(t, d.tokenID); left != 999 {
			t.Fatalf("uses left %d after the admitted join, want 999", left)
		}
		r = d.requestRow(t, df.GetRequestId())
		if r.State != store.JoinRequestConsumed || r.NodeID != got.Body.NodeId || r.ConsumedAt == nil {
			t.Fatalf("request %+v: want consumed by %s", r, got.Body.NodeId)
		}
		joined := d.events(t, d.root, "node.joined")
		if len(joined) != 1 || joined[0].Data["joinRequestId"] != df.GetRequestId() || joined[0].Data["attestor"] != discovery.Name {
			t.Fatalf("node.joined %+v: want the join request and the attestor", joined)
		}
		// The very same request again gets its stored answer (R4.9)...
		res2, err := d.joinWith(d.svc, final)
		if err != nil || string(res2.GetBody()) != string(res.GetBody()) {
			t.Fatalf("the same request again: %v; want the stored answer", err)
		}
		// ...and any other request with that CSR is refused: the approval
		// admitted one join.
		other := proto.Clone(m2.Claims).(*agentv1.Claims)
		other.Hostname = "ramdisk-2"
		m3 := &jointest.Machine{Key: m2.Key, CSR: m2.CSR, Claims: other}
		d.refusedOnce(t, d.root, "discovery:join-request-consumed", func() error {
			_, err := d.joinWith(d.svc, d.request(t, m3, d.ramdisk, boot1, time.Time{}))
			return err
		})
		if n := len(d.nodes(t, d.root)); n != 1 {
			t.Fatalf("%d nodes, want 1", n)
		}
	})
}

// R10.3: 50 concurrent retries with the approved CSR (each a different
// request) admit exactly one join and spend one use.
func TestApprovalAdmitsExactlyOne(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalAlways)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		m := ramdiskMachine(t, boot1.mac)
		df := d.mustDefer(t, d.svc, m, d.request(t, m, d.ramdisk, boot1, time.Time{}))
		d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())

		const n = 50
		reqs := make([]*agentv1.JoinRequest, n)
		for i := range reqs {
			c := proto.Clone(m.Claims).(*agentv1.Claims)
			c.Hostname = fmt.Sprintf("ramdisk-%d", i) // another request, the same CSR
			reqs[i] = d.request(t, &jointest.Machine{Key: m.Key, CSR: m.CSR, Claims: c}, d.ramdisk, boot1, time.Time{})
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		admitted := 0
		for _, req := range reqs {
			wg.Go(func() {
				res, err := d.joinWith(d.svc, req)
				switch {
				case err == nil && res.GetChallenge() == nil:
					mu.Lock()
					admitted++
					mu.Unlock()
				case err != nil && (errs.CodeOf(err) == errs.AccessDenied || errs.CodeOf(err) == errs.Conflict):
				default:
					t.Errorf("join: %v, %v", res, err)
				}
			})
		}
		wg.Wait()
		if admitted != 1 {
			t.Fatalf("%d joins admitted, want exactly 1", admitted)
		}
		if nodes := d.nodes(t, d.root); len(nodes) != 1 {
			t.Fatalf("%d nodes, want 1", len(nodes))
		}
		if left := d.usesLeft(t, d.tokenID); left != 999 {
			t.Fatalf("uses left %d, want 999", left)
		}
	})
}

// R10.3: a rejected request makes the retry with its CSR fail; another
// attempt of the machine (a new CSR) opens a new request.
func TestRejectedRequestFails(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalAlways)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		m := ramdiskMachine(t, boot1.mac)
		df := d.mustDefer(t, d.svc, m, d.request(t, m, d.ramdisk, boot1, time.Time{}))
		d.decide(t, df.GetRequestId(), 0, time.Now())
		d.refusedOnce(t, d.root, "discovery:join-request-rejected", func() error {
			_, err := d.joinWith(d.svc, d.request(t, m, d.ramdisk, boot1, time.Time{}))
			return err
		})
		if r := d.requestRow(t, df.GetRequestId()); r.State != store.JoinRequestRejected {
			t.Fatalf("request state %s, want rejected", r.State)
		}
		m2 := ramdiskMachine(t, boot1.mac)
		if again := d.mustDefer(t, d.svc, m2, d.request(t, m2, d.ramdisk, boot1, time.Time{})); again.GetRequestId() == df.GetRequestId() {
			t.Fatal("a new attempt after a rejection reused the rejected request")
		}
		if n, left := len(d.nodes(t, d.root)), d.usesLeft(t, d.tokenID); n != 0 || left != 1000 {
			t.Fatalf("%d nodes and %d uses left, want 0 and 1000", n, left)
		}
	})
}

// R10.3: an approval lasts its TTL; a retry after it ran out waits on a
// new request, and the expired one is recorded as such.
func TestApprovalExpires(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalAlways)
		fake := clock.NewFake(time.Now())
		reg, err := attest.NewRegistry(jointoken.New(), discovery.New())
		if err != nil {
			t.Fatal(err)
		}
		core, err := nodeident.New(nodeident.Config{DB: e.DB, Bundle: e.Bundle, Clock: fake, Hub: e.Server.Hub()})
		if err != nil {
			t.Fatal(err)
		}
		svc, err := join.New(join.Config{DB: e.DB, Core: core, Attestors: reg, Clock: fake, Hub: e.Server.Hub()})
		if err != nil {
			t.Fatal(err)
		}
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		m := ramdiskMachine(t, boot1.mac)
		df := d.mustDefer(t, svc, m, d.request(t, m, d.ramdisk, boot1, fake.Now()))
		d.decide(t, df.GetRequestId(), time.Minute, fake.Now())
		fake.Advance(time.Minute + time.Second)
		again := d.mustDefer(t, svc, m, d.request(t, m, d.ramdisk, boot1, fake.Now()))
		if again.GetRequestId() == df.GetRequestId() {
			t.Fatal("the retry after the approval ran out was admitted or reused the request")
		}
		if r := d.requestRow(t, df.GetRequestId()); r.State != store.JoinRequestExpired {
			t.Fatalf("request state %s, want expired", r.State)
		}
		if n := len(d.nodes(t, d.root)); n != 0 {
			t.Fatalf("%d nodes, want 0", n)
		}
	})
}

// R10.4: the vouch must come from a site agent of the token's site, for
// this boot's lease epoch and address, used from that address as the
// gateway saw it, for a NIC the machine claims; only
// ramdisks join through discovery, with a ramdisk token.
func TestDiscoveryVouchRefusals(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalNever)
		other := mkSite(t, e.Admin, d.root, "eu-2")
		nodeTok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
		const (
			elsewhere = "00:1b:21:00:00:01" // vouched only at the other site
			older     = "00:1b:21:00:00:02" // vouched with epoch 5
			unknown   = "00:1b:21:00:00:03" // vouched nowhere
		)
		d.vouch(t, other.Id, elsewhere, "10.0.0.1", 1)
		d.vouch(t, d.site.Id, older, "10.0.0.2", 5)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		for _, tc := range []struct {
			name, reason string
			req          func(t *testing.T) *agentv1.JoinRequest
			peer         string // "" : the boot address (bootPeer)
		}{
			{"a vouch from another site", "vouch-site", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, elsewhere), d.ramdisk, boot{elsewhere, "10.0.0.1", 1}, time.Time{})
			}, ""},
			{"an older lease epoch", "vouch-epoch", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, older), d.ramdisk, boot{older, "10.0.0.2", 4}, time.Time{})
			}, ""},
			{"no vouch", "vouch-missing", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, unknown), d.ramdisk, boot{unknown, "10.0.0.3", 1}, time.Time{})
			}, ""},
			{"another address", "vouch-ip", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, boot1.mac), d.ramdisk, boot{boot1.mac, "10.0.0.99", boot1.epoch}, time.Time{})
			}, ""},
			// R10.4: boot_ip is the machine's own word; the address the
			// gateway saw must be the vouched one.
			{"the vouched address from another peer", "vouch-peer", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, boot1.mac), d.ramdisk, boot1, time.Time{})
			}, "192.0.2.9:40000"},
			{"no peer address", "vouch-peer", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, boot1.mac), d.ramdisk, boot1, time.Time{})
			}, "-"},
			{"a NIC the machine does not claim", "discovery-mac", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, unknown), d.ramdisk, boot1, time.Time{})
			}, ""},
			{"a node token", "token-role", func(t *testing.T) *agentv1.JoinRequest {
				return d.request(t, ramdiskMachine(t, boot1.mac), nodeTok.Token, boot1, time.Time{})
			}, ""},
			{"the node role", "discovery-role", func(t *testing.T) *agentv1.JoinRequest {
				m := ramdiskMachine(t, boot1.mac)
				req := d.request(t, m, d.ramdisk, boot1, time.Time{})
				req.Role = pki.RoleNode
				req.SealedToken = jointest.Seal(t, e.Bundle, d.ramdisk, req)
				return req
			}, ""},
		} {
			t.Run(tc.name, func(t *testing.T) {
				d.refusedOnce(t, d.root, "discovery:"+tc.reason, func() error {
					req := tc.req(t)
					peer := tc.peer
					switch peer {
					case "":
						peer = bootPeer(req, "")
					case "-":
						peer = ""
					}
					_, err := d.joinFrom(d.svc, req, peer)
					return err
				})
			})
		}
		if n, left := len(d.nodes(t, d.root)), d.usesLeft(t, d.tokenID); n != 0 || left != 1000 {
			t.Fatalf("%d nodes and %d uses left after refusals, want 0 and 1000", n, left)
		}
		// The vouched boot itself is admitted at once (approval never),
		// also from the IPv4-mapped form of its address (a dual-stack
		// gateway listener).
		m := ramdiskMachine(t, boot1.mac)
		res, err := d.joinFrom(d.svc, d.request(t, m, d.ramdisk, boot1, time.Time{}), "[::ffff:"+boot1.ip+"]:40000")
		if err != nil {
			t.Fatalf("the vouched boot: %v", err)
		}
		if got := m.Verify(t, e.Bundle, res, pki.RoleRamdisk); got.Leaf.NotAfter.Sub(got.Leaf.NotBefore) > nodeident.MaxRamdiskCertTTL {
			t.Fatalf("ramdisk certificate lives %s, want at most %s (R7.1)", got.Leaf.NotAfter.Sub(got.Leaf.NotBefore), nodeident.MaxRamdiskCertTTL)
		}
	})
}

// R10.4, R15.3: in every approval mode a machine that is already a node
// (its trusted hardware key) waits for a person before its ramdisk reclaims
// the node, and its node is untouched while it waits; an unknown machine
// waits in "unknown-machines" and "always" and is admitted in "never". The
// approved reclaim keeps the node's id at its next generation.
func TestDiscoveryApprovalModes(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for i, tc := range []struct {
			mode         string
			unknownWaits bool
		}{
			{tenancy.ApprovalUnknownMachines, true},
			{tenancy.ApprovalAlways, true},
			{tenancy.ApprovalNever, false},
		} {
			t.Run(tc.mode, func(t *testing.T) {
				d := newDiscoIn(t, f, tc.mode)
				// A known machine: joined the pool with a node token.
				claims := jointest.Claims(7 + i)
				b := boot{claims.Macs[0], fmt.Sprintf("10.0.1.%d", 7+i), 1}
				tok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
				node := d.mustJoin(t, jointest.NewMachine(t, claims), tok.Token, pki.RoleNode).Body.NodeId
				d.vouch(t, d.site.Id, b.mac, b.ip, b.epoch)
				rd := jointest.NewMachine(t, claims)
				df := d.mustDefer(t, d.svc, rd, d.request(t, rd, d.ramdisk, b, time.Time{}))
				d.untouched(t, node, "while its machine waits for approval")
				// R22.2: the request names the node it takes.
				jr := d.getRequest(t, df.GetRequestId())
				if jr.Effect != store.JoinEffectReclaim || jr.EffectNodeID != node || jr.VouchedBy == "" {
					t.Fatalf("the ramdisk's request: effect %q node %q vouched by %q, want a reclaim of %s with its vouch", jr.Effect, jr.EffectNodeID, jr.VouchedBy, node)
				}
				// An approval that did not acknowledge the node (written
				// past the API, which refuses it) admits nothing.
				d.approveUnacknowledged(t, df.GetRequestId())
				d.refusedOnce(t, d.root, "discovery:"+join.ReasonReclaimUnacknowledged, func() error {
					_, err := d.joinWith(d.svc, d.request(t, rd, d.ramdisk, b, time.Time{}))
					return err
				})
				d.untouched(t, node, "after an unacknowledged approval")
				d.reset(t, df.GetRequestId())
				d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())
				res, err := d.joinWith(d.svc, d.request(t, rd, d.ramdisk, b, time.Time{}))
				if err != nil {
					t.Fatalf("the approved reclaim: %v", err)
				}
				if got := rd.Verify(t, e.Bundle, res, pki.RoleRamdisk); got.Body.NodeId != node || got.Body.IdentityGeneration != 2 {
					t.Fatalf("the approved ramdisk joined as %s generation %d, want its machine's node %s at generation 2", got.Body.NodeId, got.Body.IdentityGeneration, node)
				}
				// An unknown machine.
				um := ramdiskMachine(t, boot1.mac)
				d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
				req := d.request(t, um, d.ramdisk, boot1, time.Time{})
				if tc.unknownWaits {
					d.mustDefer(t, d.svc, um, req)
					return
				}
				res, err = d.joinWith(d.svc, req)
				if err != nil {
					t.Fatalf("an unknown machine in mode never: %v", err)
				}
				um.Verify(t, e.Bundle, res, pki.RoleRamdisk)
			})
		}
	})
}

// R6.4: policy.joinAttestors covers every attestor: a pool that lists only
// discovery refuses token joins.
func TestPoolAttestorsCoverDiscovery(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalNever)
		if _, err := e.Admin.Pools.UpdatePoolPolicy(context.Background(), rq(&bcv1.UpdatePoolPolicyRequest{TenantId: d.root, PoolId: d.pool.Id,
			Policy: &bcv1.PoolPolicy{JoinAttestors: []string{discovery.Name}}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"join_attestors"}}})); err != nil {
			t.Fatal(err)
		}
		tok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
		d.refusedOnce(t, d.root, reason("pool-attestor"), func() error {
			_, err := d.join(t, jointest.NewMachine(t, jointest.Claims(3)), tok.Token, "")
			return err
		})
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		m := ramdiskMachine(t, boot1.mac)
		res, err := d.joinWith(d.svc, d.request(t, m, d.ramdisk, boot1, time.Time{}))
		if err != nil {
			t.Fatalf("discovery join into a discovery-only pool: %v", err)
		}
		m.Verify(t, e.Bundle, res, pki.RoleRamdisk)
	})
}

// R11.3: a node made ahead of its machine takes the first machine that
// joins naming it, in its own pool, and no other.
func TestNodeMadeAhead(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		ahead := func(pool *bcv1.Pool) string {
			t.Helper()
			id := ids.New(ids.Node, time.Now())
			err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
				_, err := tx.InsertNode(context.Background(), store.Node{ID: id, TenantID: pool.OwnerTenantId, SiteID: pool.SiteId, PoolID: pool.Id,
					Role: pki.RoleNode, State: store.NodePending, Hostname: "gpu-17"})
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			return id
		}
		id := ahead(f.pool)
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 5})
		m := jointest.NewMachine(t, jointest.Claims(11))
		req := m.Request(t, e.Bundle, "", "")
		req.NodeId = id
		req.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, req)
		res, err := f.svc.Join(context.Background(), req, join.Peer{})
		if err != nil {
			t.Fatalf("join naming the node made ahead: %v", err)
		}
		if got := m.Verify(t, e.Bundle, res, pki.RoleNode); got.Body.NodeId != id || got.Body.IdentityGeneration != 1 {
			t.Fatalf("joined as %s generation %d, want %s generation 1", got.Body.NodeId, got.Body.IdentityGeneration, id)
		}
		if n := f.node(t, id); n.State != store.NodeAdopted || !n.HardwareKeyTrusted || n.Attestor != jointoken.Name {
			t.Fatalf("node %+v: want adopted with the machine's trusted key", n)
		}
		// Another machine naming it: the node already has its machine.
		m2 := jointest.NewMachine(t, jointest.Claims(12))
		req2 := m2.Request(t, e.Bundle, "", "")
		req2.NodeId = id
		req2.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, req2)
		f.refusedOnce(t, f.root, reason("node-id-mismatch"), func() error { _, err := f.svc.Join(context.Background(), req2, join.Peer{}); return err })
		// A node made ahead in another pool.
		otherPool := mkPool(t, e.Admin, f.root, f.site.Id, "other", nil)
		id2 := ahead(otherPool)
		m3 := jointest.NewMachine(t, jointest.Claims(13))
		req3 := m3.Request(t, e.Bundle, "", "")
		req3.NodeId = id2
		req3.SealedToken = jointest.Seal(t, e.Bundle, tok.Token, req3)
		f.refusedOnce(t, f.root, reason("node-id-pool"), func() error { _, err := f.svc.Join(context.Background(), req3, join.Peer{}); return err })
		if n := f.node(t, id2); n.State != store.NodePending {
			t.Fatalf("the other pool's node is %s after a refused join, want pending", n.State)
		}
	})
}

// R22.1, R22.2: through the operator API, a ramdisk that presents the
// claims of an existing node (its product UUID and serial) on a vouch
// waits on a request that shows the vouch as evidence and names the node
// it would take, with that node as recorded. A bare approval is refused
// and leaves the node alone; an approval of a request refreshed since it
// was listed is refused as stale; the acknowledged approval reclaims the
// node and is audited with the acknowledgement.
func TestReclaimRequestThroughTheAPIR22_2(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		f := newFixture(t, e)
		d := newDiscoIn(t, f, tenancy.ApprovalUnknownMachines)
		claims := jointest.Claims(31)
		tok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
		victim := d.mustJoin(t, jointest.NewMachine(t, claims), tok.Token, pki.RoleNode).Body.NodeId
		b := boot{claims.Macs[0], "10.0.3.31", 4}
		d.vouch(t, d.site.Id, b.mac, b.ip, b.epoch)
		rd := jointest.NewMachine(t, claims)
		df := d.mustDefer(t, d.svc, rd, d.request(t, rd, d.ramdisk, b, time.Time{}))
		list := func() *bcv1.JoinRequest {
			t.Helper()
			res, err := e.Admin.JoinRequests.ListJoinRequests(ctx, rq(&bcv1.ListJoinRequestsRequest{TenantId: d.root, PoolId: d.pool.Id}))
			if err != nil || len(res.Msg.Items) != 1 || res.Msg.Items[0].Id != df.GetRequestId() {
				t.Fatalf("list: %v %+v, want the one request %s", err, res, df.GetRequestId())
			}
			return res.Msg.Items[0]
		}
		jr := list()
		ev, eff := jr.GetEvidence(), jr.GetEffect()
		if ev.GetVouchedBy() != d.agent || ev.GetBootLeaseEpoch() != b.epoch || ev.GetVouchedIp() != b.ip || ev.GetVouchedMac() != b.mac || ev.GetPeerAddress() == "" {
			t.Errorf("evidence %+v: want the vouch of %s (lease %d, %s %s) and the peer", ev, d.agent, b.epoch, b.ip, b.mac)
		}
		n := eff.GetNode()
		if eff.GetKind() != "reclaim" || n.GetId() != victim || n.GetIdentityGeneration() != 1 || n.GetRole() != pki.RoleNode ||
			!slices.Equal(n.GetSerials(), []string{claims.ProductSerial}) || !slices.Equal(n.GetMacs(), claims.Macs) || n.GetHardwareKey() != jr.HardwareKey {
			t.Fatalf("effect %+v: want the reclaim of %s at generation 1 with its serials, MACs and the request's hardware key", eff, victim)
		}
		approve := func(version, ack string) error {
			_, err := e.Admin.JoinRequests.ApproveJoinRequest(ctx, rq(&bcv1.ApproveJoinRequestRequest{TenantId: d.root, PoolId: d.pool.Id,
				RequestId: jr.Id, TtlSeconds: 900, Reason: "disk replaced", Version: version, AcknowledgeReclaimNodeId: ack}))
			return err
		}
		other := ids.New(ids.Node, time.Now())
		for _, tc := range []struct {
			name, version, ack string
			code               errs.Code
			msg                string
		}{
			{"bare", "", "", errs.InvalidState, "reclaims node " + victim},
			{"version only", jr.Version, "", errs.InvalidState, "acknowledge it by naming the node"},
			{"another node", jr.Version, other, errs.InvalidState, "not " + other},
			{"ack without version", "", victim, errs.InvalidState, "must name the version"},
			{"another version", "v1-00", victim, errs.Conflict, "changed since it was listed"},
		} {
			err := approve(tc.version, tc.ack)
			if errs.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("%s: %v, want %s %q", tc.name, err, tc.code, tc.msg)
			}
		}
		d.untouched(t, victim, "after refused approvals")
		// The machine tries again with a new key past the refresh
		// interval: the request the operator listed is stale.
		if err := e.DB.SetClockOffset(ctx, join.DefaultRefreshInterval+time.Second); err != nil {
			t.Fatal(err)
		}
		rd2 := jointest.NewMachine(t, claims)
		d.mustDefer(t, d.svc, rd2, d.request(t, rd2, d.ramdisk, b, time.Time{}))
		if err := approve(jr.Version, victim); errs.CodeOf(err) != errs.Conflict {
			t.Fatalf("approving the request as listed before its refresh: %v, want CONFLICT", err)
		}
		fresh := list()
		if fresh.Version == jr.Version || fresh.CsrSha256 == jr.CsrSha256 {
			t.Fatalf("refreshed request keeps version %s and CSR %s", fresh.Version, fresh.CsrSha256)
		}
		jr = fresh
		if err := approve(jr.Version, victim); err != nil {
			t.Fatalf("the acknowledged approval: %v", err)
		}
		res, err := d.joinWith(d.svc, d.request(t, rd2, d.ramdisk, b, time.Time{}))
		if err != nil {
			t.Fatalf("the approved reclaim: %v", err)
		}
		if got := rd2.Verify(t, e.Bundle, res, pki.RoleRamdisk); got.Body.NodeId != victim || got.Body.IdentityGeneration != 2 {
			t.Fatalf("joined as %s generation %d, want %s at generation 2", got.Body.NodeId, got.Body.IdentityGeneration, victim)
		}
		rows := d.audit(t, d.root, "join-request.approved")
		if len(rows) != 1 || rows[0].Data["acknowledgedReclaimNodeId"] != victim || rows[0].Data["effectNodeId"] != victim || rows[0].Data["version"] != jr.Version {
			t.Fatalf("approval audit rows %+v: want one with the acknowledged node %s and the version", rows, victim)
		}
	})
}

// R22.2: a request recorded as a new node whose claims then become a
// node's (that machine joined with a token meanwhile) is refreshed, on the
// ramdisk's next retry, to name the node it would now reclaim: its
// approval, given for a new node, is void, the ramdisk waits again and the
// node is untouched.
func TestRequestEffectChangesVoidApprovalR22_2(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		d := newDiscoIn(t, f, tenancy.ApprovalUnknownMachines)
		claims := jointest.Claims(41)
		b := boot{claims.Macs[0], "10.0.4.41", 2}
		d.vouch(t, d.site.Id, b.mac, b.ip, b.epoch)
		rd := jointest.NewMachine(t, claims)
		df := d.mustDefer(t, d.svc, rd, d.request(t, rd, d.ramdisk, b, time.Time{}))
		if jr := d.getRequest(t, df.GetRequestId()); jr.Effect != store.JoinEffectNew || jr.EffectNodeID != "" {
			t.Fatalf("an unknown machine's request: effect %q node %q, want a new node", jr.Effect, jr.EffectNodeID)
		}
		d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())
		before := d.getRequest(t, df.GetRequestId())
		// Meanwhile a machine with these claims joins with a token.
		tok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
		node := d.mustJoin(t, jointest.NewMachine(t, claims), tok.Token, pki.RoleNode).Body.NodeId
		again := d.mustDefer(t, d.svc, rd, d.request(t, rd, d.ramdisk, b, time.Time{}))
		jr := d.getRequest(t, again.GetRequestId())
		if jr.ID != df.GetRequestId() || jr.State != store.JoinRequestPending || jr.Effect != store.JoinEffectReclaim || jr.EffectNodeID != node ||
			jr.AcknowledgedNodeID != "" || joinreq.Version(jr) == joinreq.Version(before) {
			t.Fatalf("request after the node joined: %+v, want %s pending again as a reclaim of %s with a new version", jr, df.GetRequestId(), node)
		}
		d.untouched(t, node, "after the voided approval")
		got := d.events(t, d.root, "security.join-request.refreshed")
		if len(got) != 1 || got[0].Data["approvalVoided"] != true || got[0].Data["effectChanged"] != true || got[0].Data["effectNodeId"] != node {
			t.Fatalf("refreshed events %+v: want one saying the approval is void and the effect changed", got)
		}
	})
}
