package join_test

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R4.5, R14.1, R14.2: a join into a pool without acceptance checks commits
// the node adopted, with node.joined then node.adopted and their audit rows
// in that order, and queues nothing. What it writes is what a join followed
// by the controller's adoption wrote (the path a pool with checks still
// takes once they pass): the same events, audit rows, actors and data.
func TestJoinAdoptsInlineR4_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		ctx := context.Background()
		inline := mkPool(t, e.Admin, f.root, f.site.Id, "inline", nil)
		checked := mkPool(t, e.Admin, f.root, f.site.Id, "checked", &bcv1.PoolPolicy{Acceptance: &bcv1.AcceptancePolicy{MinCpus: 1}})
		var atCommit []string
		svc := ownServiceConfig(t, e, nil, nil, 0, func(c *join.Config) {
			// The node's state as the admission transaction committed,
			// before the answer is returned.
			c.AfterCommit = func() {
				for _, n := range f.nodes(t, f.root) {
					if n.PoolID == inline.Id {
						atCommit = append(atCommit, n.State)
					}
				}
			}
		})
		joinPool := func(pool *bcv1.Pool, i int) (*jointest.Joined, string) {
			tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.root, PoolId: pool.Id})
			m := jointest.NewMachine(t, jointest.Claims(7000+i))
			res, err := svc.Join(ctx, m.Request(t, e.Bundle, tok.Token, ""), join.Peer{Addr: "192.0.2.7:40000"})
			if err != nil {
				t.Fatalf("join %s: %v", pool.Name, err)
			}
			return m.Verify(t, e.Bundle, res, pki.RoleNode), tok.Id
		}

		a, aTok := joinPool(inline, 1)
		if want := []string{store.NodeAdopted}; !slices.Equal(atCommit, want) {
			t.Errorf("node states at commit %v, want %v", atCommit, want)
		}
		if q := f.queued(t); len(q) != 0 {
			t.Errorf("adopt queue %v, want empty", q)
		}

		// Today's other path: the node joins adopting, and a controller
		// takes the adopt item (as a previous release's join queued it).
		b, bTok := joinPool(checked, 2)
		if n := f.node(t, b.Body.NodeId); n.State != store.NodeAdopting {
			t.Fatalf("node in a pool with checks %s, want adopting", n.State)
		}
		if err := e.DB.WithTx(ctx, func(tx *store.Tx) error { return tx.EnqueueWork(ctx, join.WorkAdopt, b.Body.NodeId) }); err != nil {
			t.Fatal(err)
		}
		ctl := controller.New(controller.Config{DB: e.DB, Hub: e.Server.Hub()})
		if n, err := ctl.RunOnce(ctx); err != nil || n != 1 {
			t.Fatalf("controller took %d items (%v), want 1", n, err)
		}
		if n := f.node(t, b.Body.NodeId); n.State != store.NodeAdopted {
			t.Fatalf("node adopted by the controller %s, want adopted", n.State)
		}

		// Node, pool, serial, token and hostname differ; everything else
		// is the same.
		norm := func(j *jointest.Joined, pool, tok string) func(string) string {
			n := f.node(t, j.Body.NodeId)
			r := strings.NewReplacer(n.ID, "NODE", pool, "POOL", pki.SerialHex(j.Leaf), "SERIAL", tok, "TOKEN", n.Hostname, "HOST")
			return r.Replace
		}
		got, want := nodeRecords(t, f, a.Body.NodeId, norm(a, inline.Id, aTok)), nodeRecords(t, f, b.Body.NodeId, norm(b, checked.Id, bTok))
		if d := cmp.Diff(want, got); d != "" {
			t.Errorf("inline adoption's events and audit rows differ from the controller's (-controller +inline):\n%s", d)
		}
		if wantSeq := []string{"event node.joined", "event node.adopted", "audit node.joined node:NODE", "audit node.adopted controller"}; !slices.Equal(heads(got), wantSeq) {
			t.Errorf("records %v, want %v", heads(got), wantSeq)
		}
	})
}

// record is one event or audit row about a node, normalized.
type record struct {
	Head string
	Data map[string]any
}

func heads(rs []record) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Head
	}
	return out
}

// nodeRecords lists the events about a node in stream order, then its
// audit rows oldest first, with norm applied to every string.
func nodeRecords(t *testing.T, f *fixture, nodeID string, norm func(string) string) []record {
	t.Helper()
	var out []record
	for _, ev := range f.events(t, f.root, "") {
		if ev.Subject == nodeID {
			out = append(out, record{"event " + ev.Type, normMap(ev.Data, norm)})
		}
	}
	var rows []record
	f.read(t, func(tx *store.Tx) error {
		all, err := tx.ListAudit(context.Background(), f.root, 0, 10000)
		for _, a := range all {
			if a.Resource != "compute-node/"+nodeID {
				continue
			}
			var d map[string]any
			if err := json.Unmarshal(a.Data, &d); err != nil {
				return err
			}
			rows = append(rows, record{"audit " + a.Action + " " + norm(a.Actor), normMap(d, norm)})
		}
		return err
	})
	slices.Reverse(rows) // ListAudit is newest first
	return append(out, rows...)
}

func normMap(m map[string]any, norm func(string) string) map[string]any {
	out := make(map[string]any, len(m))
	for k, v := range m {
		if s, ok := v.(string); ok {
			v = norm(s)
		}
		out[k] = v
	}
	return out
}

// spendThenFail is the join-token attestor whose spend fails after it
// spent: the last statement of a join, after the node, its certificate,
// events, audit rows and stored answer were written.
type spendThenFail struct{ attest.Attestor }

var errInjected = errors.New("injected failure after the spend")

func (a spendThenFail) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	adm, err := a.Attestor.Admit(ctx, tx, in)
	if err != nil || adm.Spend == nil {
		return adm, err
	}
	spend := adm.Spend
	adm.Spend = func(ctx context.Context, tx *store.Tx) error {
		if err := spend(ctx, tx); err != nil {
			return err
		}
		return errInjected
	}
	return adm, nil
}

// R4.4, R4.5: a join into a pool without acceptance checks that fails after
// the node was written adopted leaves nothing: no node, no event, no audit
// row, no stored answer, no work, no use spent; the same request then joins.
func TestJoinFailingAfterAdoptLeavesNothingR4_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		ctx := context.Background()
		reg, err := attest.NewRegistry(spendThenFail{jointoken.New()})
		if err != nil {
			t.Fatal(err)
		}
		failing := ownServiceConfig(t, e, nil, nil, 0, func(c *join.Config) { c.Attestors = reg })
		tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 2})
		evBefore, auBefore := len(f.events(t, f.root, "")), len(f.audit(t, f.root, "node.joined"))+len(f.audit(t, f.root, "node.adopted"))
		m := jointest.NewMachine(t, jointest.Claims(7100))
		req := m.Request(t, e.Bundle, tok.Token, "")
		if _, err := failing.Join(ctx, req, join.Peer{}); !errors.Is(err, errInjected) {
			t.Fatalf("join: %v, want the injected failure", err)
		}
		if n := f.nodes(t, f.root); len(n) != 0 {
			t.Errorf("nodes %+v, want none", n)
		}
		if evs := f.events(t, f.root, ""); len(evs) != evBefore {
			t.Errorf("events %+v, want the %d from before", evs[evBefore:], evBefore)
		}
		if n := len(f.audit(t, f.root, "node.joined")) + len(f.audit(t, f.root, "node.adopted")); n != auBefore {
			t.Errorf("%d node audit rows, want %d", n, auBefore)
		}
		if q := f.queued(t); len(q) != 0 {
			t.Errorf("work %v, want none", q)
		}
		if got := f.usesLeft(t, tok.Id); got != 2 {
			t.Errorf("uses left %d, want 2", got)
		}
		res, err := f.svc.Join(ctx, req, join.Peer{})
		if err != nil {
			t.Fatalf("the same request to a working service: %v", err)
		}
		if j := m.Verify(t, e.Bundle, res, pki.RoleNode); f.node(t, j.Body.NodeId).State != store.NodeAdopted {
			t.Errorf("node %+v, want adopted", f.node(t, j.Body.NodeId))
		}
	})
}
