package join_test

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// the races that decide a single winner (a token's last use, an
// approval, a node's reclaim) run through two API replicas at once. Each
// replica is a JoinService of its own, with its own identity core and
// refusal limiter: on SQLite both share the one store handle (SQLite
// serves one process); on PostgreSQL each has its own handle (connection
// pool, sequencer, caches) on one schema, as two `serve` processes have.
// The operator side (tokens, approvals) and the reads go through replica
// 0's API.

// raceGoroutines is how many joins each race starts at once, split evenly
// over the two replicas.
const raceGoroutines = 24

// replicaPair is one API (e, on replica 0's store) and the JoinServices of
// two replicas.
type replicaPair struct {
	e    *apitest.Env
	svcs [2]*join.Service
}

// eachReplicaPair runs fn on SQLite (one handle, two JoinServices) and on
// PostgreSQL (two handles, a JoinService on each).
func eachReplicaPair(t *testing.T, opts apitest.Options, fn func(t *testing.T, p replicaPair)) {
	t.Helper()
	pair := func(t *testing.T, a, b *store.DB) {
		e := apitest.Start(t, a, opts)
		var p replicaPair
		p.e = e
		for i, db := range []*store.DB{a, b} {
			p.svcs[i] = replicaService(t, e, db)
		}
		fn(t, p)
	}
	t.Run("sqlite", func(t *testing.T) { db := storetest.OpenSQLite(t); pair(t, db, db) })
	t.Run("postgres", func(t *testing.T) { dbs := storetest.PostgresReplicas(t, 2); pair(t, dbs[0], dbs[1]) })
}

// replicaService builds the JoinService a replica on db runs: the join-token
// and discovery attestors, the wall clock, nodeident's default limiter, and
// no event hub (another process's hub would not hear it).
func replicaService(t testing.TB, e *apitest.Env, db *store.DB) *join.Service {
	t.Helper()
	reg, err := attest.NewRegistry(jointoken.New(), discovery.New())
	if err != nil {
		t.Fatal(err)
	}
	core, err := nodeident.New(nodeident.Config{DB: db, Bundle: e.Bundle, Clock: clock.Real{}})
	if err != nil {
		t.Fatal(err)
	}
	svc, err := join.New(join.Config{DB: db, Core: core, Attestors: reg, Clock: clock.Real{}})
	if err != nil {
		t.Fatal(err)
	}
	return svc
}

// outcome is one racer's answer.
type raceOutcome struct {
	res *agentv1.JoinResponse
	err error
}

// race sends reqs[i] through replica i%2, all released at once by a
// barrier, and returns the answers in order.
func (p replicaPair) race(t *testing.T, reqs []*agentv1.JoinRequest) []raceOutcome {
	t.Helper()
	out := make([]raceOutcome, len(reqs))
	ready := sync.WaitGroup{}
	ready.Add(len(reqs))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Go(func() {
			ready.Done()
			<-start
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// A ramdisk connects from its boot address (R10.4).
			out[i].res, out[i].err = p.svcs[i%2].Join(ctx, req, join.Peer{Addr: bootPeer(req, fmt.Sprintf("192.0.2.%d:40000", 10+i%2))})
		})
	}
	ready.Wait()
	close(start)
	wg.Wait()
	return out
}

// isRace says whether err is the answer to a loser of a race of one
// machine (R4.8), checking its message when its code is CONFLICT.
func isRace(t testing.TB, err error) bool {
	t.Helper()
	if errs.CodeOf(err) != errs.Conflict {
		return false
	}
	jointest.WantError(t, err, errs.Conflict, jointest.RaceMessage)
	return true
}

// R4.4, R4.7: a token's last uses race through two replicas.
// 24 distinct machines join at once, half on each replica, with a token of
// 1 use and with a token of 5 uses: exactly that many are admitted, every
// other one is refused with the uniform refusal (reason token-used-up), no
// use is spent twice or left over, and exactly one node (one node.joined
// event, one certificate) exists per admission.
func TestTokenLastUseAcrossReplicasR4_4(t *testing.T) {
	eachReplicaPair(t, apitest.Options{}, func(t *testing.T, p replicaPair) {
		f := newFixture(t, p.e)
		base := 120000
		for _, uses := range []int{1, 5} {
			t.Run(fmt.Sprintf("%d uses", uses), func(t *testing.T) {
				// Each round in a tenant's pool of its own, so its counts
				// are its own.
				tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, MaxUses: int32(uses)})
				before := len(f.nodes(t, f.acme))
				refusalsBefore := len(jointest.Refusals(t, p.e.DB, f.acme))
				machines := make([]*jointest.Machine, raceGoroutines)
				reqs := make([]*agentv1.JoinRequest, raceGoroutines)
				for i := range reqs {
					machines[i] = jointest.NewMachine(t, jointest.Claims(base+i))
					reqs[i] = machines[i].Request(t, p.e.Bundle, tok.Token, "")
				}
				base += raceGoroutines
				admitted := map[string]bool{}
				perReplica := [2]int{}
				for i, o := range p.race(t, reqs) {
					if o.err != nil {
						jointest.WantRefused(t, o.err)
						continue
					}
					got := machines[i].Verify(t, p.e.Bundle, o.res, pki.RoleNode)
					if admitted[got.Body.NodeId] {
						t.Fatalf("node %s admitted twice", got.Body.NodeId)
					}
					admitted[got.Body.NodeId] = true
					perReplica[i%2]++
				}
				if len(admitted) != uses {
					t.Fatalf("%d machines admitted (per replica %v) by a token of %d uses, want exactly %d", len(admitted), perReplica, uses, uses)
				}
				if left := f.usesLeft(t, tok.Id); left != 0 {
					t.Errorf("uses left %d, want 0", left)
				}
				var fromToken []store.Node
				for _, n := range f.nodes(t, f.acme) {
					if n.JoinTokenID == tok.Id {
						fromToken = append(fromToken, n)
					}
				}
				if len(fromToken) != uses || len(f.nodes(t, f.acme)) != before+uses {
					t.Fatalf("%d nodes joined with the token, want %d", len(fromToken), uses)
				}
				for _, n := range fromToken {
					if !admitted[n.ID] || n.IdentityGeneration != 1 || n.State != store.NodeAdopted {
						t.Errorf("node %+v: want one of the admitted, generation 1, adopted", n)
					}
					if certs := f.certs(t, n.ID); len(certs) != 1 {
						t.Errorf("node %s has %d certificates, want 1", n.ID, len(certs))
					}
				}
				joined := 0
				for _, ev := range f.events(t, f.acme, "node.joined") {
					if ev.Data["joinTokenId"] == tok.Id {
						joined++
					}
				}
				if joined != uses {
					t.Errorf("%d node.joined events for the token, want %d", joined, uses)
				}
				refusals := jointest.Refusals(t, p.e.DB, f.acme)[refusalsBefore:]
				if len(refusals) != raceGoroutines-uses {
					t.Errorf("%d refusal events, want %d", len(refusals), raceGoroutines-uses)
				}
				for _, r := range refusals {
					if r.Reason != reason("token-used-up") {
						t.Errorf("refusal %+v, want reason %s", r, reason("token-used-up"))
					}
				}
				t.Logf("%s: %d of %d admitted, per replica %v", p.e.DB.Dialect(), len(admitted), raceGoroutines, perReplica)
			})
		}
	})
}

// approvedMachine sets up a discovery pool whose every machine waits for
// a person (approval always), defers one ramdisk machine, and approves its
// request for 15 minutes.
func approvedMachine(t *testing.T, p replicaPair) (*disco, *jointest.Machine, string) {
	t.Helper()
	d := newDisco(t, p.e, tenancy.ApprovalAlways)
	d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
	m := ramdiskMachine(t, boot1.mac)
	df := d.mustDefer(t, p.svcs[1], m, d.request(t, m, d.ramdisk, boot1, time.Time{}))
	d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())
	return d, m, df.GetRequestId()
}

// wantOneApprovedNode checks what an approval leaves: the request consumed
// by node, one node, one use spent, one node.joined event naming the
// request.
func wantOneApprovedNode(t *testing.T, d *disco, reqID, node string) {
	t.Helper()
	if r := d.requestRow(t, reqID); r.State != store.JoinRequestConsumed || r.NodeID != node || r.ConsumedAt == nil {
		t.Errorf("request %+v: want consumed by %s", r, node)
	}
	if nodes := d.nodes(t, d.root); len(nodes) != 1 || nodes[0].ID != node {
		t.Errorf("nodes %+v, want only %s", nodes, node)
	}
	if left := d.usesLeft(t, d.tokenID); left != 999 {
		t.Errorf("uses left %d, want 999: one use for the one admission", left)
	}
	joined := d.events(t, d.root, "node.joined")
	if len(joined) != 1 || joined[0].Data["joinRequestId"] != reqID || joined[0].Data["nodeId"] != node {
		t.Errorf("node.joined events %+v, want one for %s naming %s", joined, node, reqID)
	}
}

// R10.3, R4.9: an approval raced through two replicas admits
// exactly one join.
//   - The approved machine's very request retried 24 times at once (bcd
//     and the gateway retrying it on both replicas): one admission
//     consumes the approval; every other attempt gets that same answer,
//     byte for byte (the stored answer), or CONFLICT; one node.
//   - 24 distinct requests with the approved CSR (claims differ): exactly
//     one admitted; the others CONFLICT or refused (join-request-consumed).
//   - The approved CSR's requests racing newer attempts of the machine (new
//     keys and CSRs, which void an approval given for the older CSR): at
//     most one admission, for the approved CSR; at most one open request
//     for the machine; never a second node.
func TestApprovalAcrossReplicasR10_3(t *testing.T) {
	opts := apitest.Options{Attestors: []string{jointoken.Name, discovery.Name}}
	t.Run("the same request", func(t *testing.T) {
		eachReplicaPair(t, opts, func(t *testing.T, p replicaPair) {
			d, m, reqID := approvedMachine(t, p)
			req := d.request(t, m, d.ramdisk, boot1, time.Time{})
			reqs := make([]*agentv1.JoinRequest, raceGoroutines)
			for i := range reqs {
				reqs[i] = proto.Clone(req).(*agentv1.JoinRequest)
			}
			var answer []byte
			var answered, conflicts int
			for i, o := range p.race(t, reqs) {
				switch {
				case o.err == nil:
					m.Verify(t, p.e.Bundle, o.res, pki.RoleRamdisk)
					if answer != nil && !bytes.Equal(o.res.GetBody(), answer) {
						t.Fatalf("attempt %d got another answer than an earlier attempt of the same request", i)
					}
					answer = o.res.GetBody()
					answered++
				case isRace(t, o.err):
					conflicts++
				default:
					t.Fatalf("attempt %d of the approved request: %v, want its answer or CONFLICT", i, o.err)
				}
			}
			if answer == nil {
				t.Fatal("no attempt of the approved request was admitted")
			}
			var body agentv1.JoinResponseBody
			if err := proto.Unmarshal(answer, &body); err != nil {
				t.Fatal(err)
			}
			wantOneApprovedNode(t, d, reqID, body.NodeId)
			if r := jointest.Refusals(t, p.e.DB, d.root); len(r) != 0 {
				t.Errorf("refusals %+v for attempts of an admitted request, want none", r)
			}
			t.Logf("%s: %d attempts answered (one admission), %d CONFLICT", p.e.DB.Dialect(), answered, conflicts)
		})
	})
	t.Run("distinct requests", func(t *testing.T) {
		eachReplicaPair(t, opts, func(t *testing.T, p replicaPair) {
			d, m, reqID := approvedMachine(t, p)
			machines := make([]*jointest.Machine, raceGoroutines)
			reqs := make([]*agentv1.JoinRequest, raceGoroutines)
			for i := range reqs {
				c := proto.Clone(m.Claims).(*agentv1.Claims)
				c.Hostname = fmt.Sprintf("ramdisk-%d", i) // another request, the same CSR
				machines[i] = &jointest.Machine{Key: m.Key, CSR: m.CSR, Claims: c}
				reqs[i] = d.request(t, machines[i], d.ramdisk, boot1, time.Time{})
			}
			winner, conflicts, refused := "", 0, 0
			for i, o := range p.race(t, reqs) {
				switch {
				case o.err == nil:
					got := machines[i].Verify(t, p.e.Bundle, o.res, pki.RoleRamdisk)
					if winner != "" {
						t.Fatalf("two joins admitted by one approval: %s and %s", winner, got.Body.NodeId)
					}
					winner = got.Body.NodeId
				case isRace(t, o.err):
					conflicts++
				default:
					jointest.WantRefused(t, o.err)
					refused++
				}
			}
			if winner == "" {
				t.Fatal("no join admitted by the approval")
			}
			wantOneApprovedNode(t, d, reqID, winner)
			for _, r := range jointest.Refusals(t, p.e.DB, d.root) {
				if r.Reason != "discovery:join-request-consumed" {
					t.Errorf("refusal %+v, want discovery:join-request-consumed", r)
				}
			}
			t.Logf("%s: 1 admitted, %d CONFLICT, %d refused", p.e.DB.Dialect(), conflicts, refused)
		})
	})
	t.Run("approved and newer CSRs", func(t *testing.T) {
		eachReplicaPair(t, opts, func(t *testing.T, p replicaPair) {
			d, m, reqID := approvedMachine(t, p)
			machines := make([]*jointest.Machine, raceGoroutines)
			reqs := make([]*agentv1.JoinRequest, raceGoroutines)
			for i := range reqs {
				if i%4 < 2 {
					c := proto.Clone(m.Claims).(*agentv1.Claims)
					c.Hostname = fmt.Sprintf("ramdisk-%d", i)
					machines[i] = &jointest.Machine{Key: m.Key, CSR: m.CSR, Claims: c}
				} else {
					machines[i] = ramdiskMachine(t, boot1.mac) // a newer attempt: new key, new CSR
				}
				reqs[i] = d.request(t, machines[i], d.ramdisk, boot1, time.Time{})
			}
			winner, deferred, conflicts, refused := "", 0, 0, 0
			for i, o := range p.race(t, reqs) {
				switch {
				case o.err == nil && o.res.GetChallenge() == nil && isDeferral(t, o.res):
					machines[i].Deferral(t, p.e.Bundle, o.res)
					deferred++
				case o.err == nil:
					got := machines[i].Verify(t, p.e.Bundle, o.res, pki.RoleRamdisk)
					if i%4 >= 2 {
						t.Fatalf("a newer CSR than the approved one was admitted: %s", got.Body.NodeId)
					}
					if winner != "" {
						t.Fatalf("two joins admitted by one approval: %s and %s", winner, got.Body.NodeId)
					}
					winner = got.Body.NodeId
				case isRace(t, o.err):
					conflicts++
				default:
					jointest.WantRefused(t, o.err)
					refused++
				}
			}
			nodes := d.nodes(t, d.root)
			switch {
			case winner != "":
				wantOneApprovedNode(t, d, reqID, winner)
			case len(nodes) != 0:
				t.Fatalf("nodes %+v with no join admitted", nodes)
			default:
				// A newer attempt came first and voided the approval.
				if r := d.requestRow(t, reqID); r.State == store.JoinRequestConsumed || r.State == store.JoinRequestApproved {
					t.Errorf("request %+v: an approval neither admitted nor voided", r)
				}
				if left := d.usesLeft(t, d.tokenID); left != 1000 {
					t.Errorf("uses left %d with no admission, want 1000", left)
				}
			}
			open := 0
			for _, r := range d.requests(t) {
				if r.State == store.JoinRequestPending || r.State == store.JoinRequestApproved {
					open++
				}
			}
			if open > 1 {
				t.Errorf("%d open requests for one machine, want at most 1 (R10.2)", open)
			}
			t.Logf("%s: admitted %v, %d deferred, %d CONFLICT, %d refused %v", p.e.DB.Dialect(), winner != "", deferred, conflicts, refused,
				jointest.Reasons(t, p.e.DB, d.root))
		})
	})
}

// isDeferral says whether a successful answer is a deferral rather than
// a certificate.
func isDeferral(t testing.TB, res *agentv1.JoinResponse) bool {
	t.Helper()
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
		t.Fatalf("answer body: %v", err)
	}
	return body.GetDeferral() != nil
}

// reclaimable joins a machine of claims into acme's pool (generation 1)
// and mints an allowReclaim token of uses for it.
func reclaimable(t *testing.T, f *fixture, claims *agentv1.Claims, uses int32) (node string, tok *bcv1.JoinToken) {
	t.Helper()
	first := f.mustJoin(t, jointest.NewMachine(t, claims), f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id}).Token, pki.RoleNode)
	return first.Body.NodeId, f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, AllowReclaim: true, MaxUses: uses})
}

// wantReclaimed checks the machine's node after reclaims: one node, at
// generation 1+won, won uses spent of 30, one certificate per generation
// and only last's unrevoked, won node.reclaimed rows, no refusal.
func wantReclaimed(t *testing.T, f *fixture, id string, tok *bcv1.JoinToken, won int, last *jointest.Joined) {
	t.Helper()
	if n := f.node(t, id); n.IdentityGeneration != 1+won {
		t.Fatalf("generation %d after %d reclaims, want %d", n.IdentityGeneration, won, 1+won)
	}
	if all := f.nodes(t, f.acme); len(all) != 1 {
		t.Fatalf("%d nodes, want 1", len(all))
	}
	if left := f.usesLeft(t, tok.Id); left != 30-won {
		t.Errorf("uses left %d after %d reclaims, want %d", left, won, 30-won)
	}
	live := 0
	certs := f.certs(t, id)
	for _, c := range certs {
		if c.RevokedAt == nil {
			live++
			if c.IdentityGeneration != 1+won || !bytes.Equal(c.DER, last.Leaf.Raw) {
				t.Errorf("unrevoked certificate of generation %d, want only the last winner's (%d)", c.IdentityGeneration, 1+won)
			}
		}
	}
	if live != 1 || len(certs) != 1+won {
		t.Errorf("%d certificates, %d unrevoked; want %d, 1", len(certs), live, 1+won)
	}
	if rows := f.audit(t, f.acme, "node.reclaimed"); len(rows) != won {
		t.Errorf("%d node.reclaimed audit rows, want %d", len(rows), won)
	}
	if r := jointest.Refusals(t, f.e.DB, f.acme); len(r) != 0 {
		t.Errorf("refusals %+v, want none", r)
	}
}

// R6.3, R4.8, R4.9: one machine's reclaim raced through two
// replicas, with an allowReclaim token of 30 uses, after the machine
// joined (generation 1).
//   - Its reclaim request (a new key) retried 24 times at once, half on
//     each replica: exactly one reclaim (generation 2, one use); every
//     other attempt gets that answer byte for byte, or CONFLICT "This
//     machine joined concurrently; retry"; never a refusal.
//   - 24 attempts of the machine, each with a key and CSR of its own:
//     attempts that read the same generation have one winner (the others
//     get CONFLICT); an attempt that runs after a reclaim committed
//     reclaims the node again, as a later re-install would. So no two
//     admissions share a generation, the node ends at 1 + the admissions,
//     one use is spent per admission, and only the last winner's
//     certificate is unrevoked: one node, one live identity.
func TestReclaimAcrossReplicasR6_3(t *testing.T) {
	t.Run("the same request", func(t *testing.T) {
		eachReplicaPair(t, apitest.Options{}, func(t *testing.T, p replicaPair) {
			f := newFixture(t, p.e)
			claims := jointest.Claims(130001)
			id, tok := reclaimable(t, f, claims, 30)
			m := jointest.NewMachine(t, claims)
			req := m.Request(t, p.e.Bundle, tok.Token, "")
			reqs := make([]*agentv1.JoinRequest, raceGoroutines)
			for i := range reqs {
				reqs[i] = proto.Clone(req).(*agentv1.JoinRequest)
			}
			var answer *jointest.Joined
			answered, conflicts := 0, 0
			for i, o := range p.race(t, reqs) {
				switch {
				case o.err == nil:
					got := m.Verify(t, p.e.Bundle, o.res, pki.RoleNode)
					if answer != nil && !bytes.Equal(got.Leaf.Raw, answer.Leaf.Raw) {
						t.Fatalf("attempt %d got another certificate than an earlier attempt of the same request", i)
					}
					answer = got
					answered++
				case isRace(t, o.err):
					conflicts++
				default:
					t.Fatalf("attempt %d of the reclaim: %v, want its answer or CONFLICT", i, o.err)
				}
			}
			if answer == nil {
				t.Fatal("no attempt of the reclaim was admitted")
			}
			if answer.Body.NodeId != id || answer.Body.IdentityGeneration != 2 {
				t.Fatalf("reclaimed node %s generation %d, want %s generation 2", answer.Body.NodeId, answer.Body.IdentityGeneration, id)
			}
			wantReclaimed(t, f, id, tok, 1, answer)
			t.Logf("%s: %d attempts answered (one reclaim), %d CONFLICT", p.e.DB.Dialect(), answered, conflicts)
		})
	})
	t.Run("distinct keys", func(t *testing.T) {
		eachReplicaPair(t, apitest.Options{}, func(t *testing.T, p replicaPair) {
			f := newFixture(t, p.e)
			claims := jointest.Claims(130002)
			id, tok := reclaimable(t, f, claims, 30)
			machines := make([]*jointest.Machine, raceGoroutines)
			reqs := make([]*agentv1.JoinRequest, raceGoroutines)
			for i := range reqs {
				machines[i] = jointest.NewMachine(t, claims)
				reqs[i] = machines[i].Request(t, p.e.Bundle, tok.Token, "")
			}
			byGen := map[int64]*jointest.Joined{}
			conflicts := 0
			for i, o := range p.race(t, reqs) {
				switch {
				case o.err == nil:
					got := machines[i].Verify(t, p.e.Bundle, o.res, pki.RoleNode)
					g := got.Body.IdentityGeneration
					if got.Body.NodeId != id {
						t.Fatalf("attempt %d joined as node %s, want the machine's node %s", i, got.Body.NodeId, id)
					}
					if byGen[g] != nil {
						t.Fatalf("two reclaims won generation %d", g)
					}
					byGen[g] = got
				case isRace(t, o.err):
					conflicts++
				default:
					t.Fatalf("attempt %d: %v, want a reclaim or CONFLICT", i, o.err)
				}
			}
			won := len(byGen)
			if won == 0 {
				t.Fatal("no reclaim won")
			}
			for g := int64(2); g <= int64(1+won); g++ {
				if byGen[g] == nil {
					t.Fatalf("no winner of generation %d of %d", g, 1+won)
				}
			}
			wantReclaimed(t, f, id, tok, won, byGen[int64(1+won)])
			t.Logf("%s: %d reclaims won (generation %d), %d CONFLICT", p.e.DB.Dialect(), won, 1+won, conflicts)
		})
	})
}
