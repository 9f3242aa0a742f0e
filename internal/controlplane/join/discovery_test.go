package join_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// What a holder of a site's ramdisk token can do with a vouch (R15.3): the
// token is in every network-boot image, so it proves little; the vouch
// proves a boot of one NIC, not which machine's claims come with it.

// admitted joins m on boot b as an honest ramdisk; if it waits, a person
// approves its request and it asks again. It returns what was issued.
func (d *disco) admitted(t testing.TB, m *jointest.Machine, b boot) *jointest.Joined {
	t.Helper()
	res, err := d.joinWith(d.svc, d.request(t, m, d.ramdisk, b, time.Time{}))
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	if isDeferral(t, res) {
		d.decide(t, m.Deferral(t, d.e.Bundle, res).GetRequestId(), 15*time.Minute, time.Now())
		if res, err = d.joinWith(d.svc, d.request(t, m, d.ramdisk, b, time.Time{})); err != nil {
			t.Fatalf("the approved join: %v", err)
		}
	}
	return m.Verify(t, d.e.Bundle, res, pki.RoleRamdisk)
}

// untouched fails unless node is still at identity generation 1 with its
// one certificate unrevoked.
func (d *disco) untouched(t testing.TB, node, when string) {
	t.Helper()
	n, certs := d.node(t, node), d.certs(t, node)
	if n.IdentityGeneration != 1 || len(certs) != 1 || certs[0].RevokedAt != nil {
		t.Fatalf("%s: node %s at generation %d with certificates %+v; want generation 1, its one certificate unrevoked",
			when, node, n.IdentityGeneration, certs)
	}
}

// R15.3, R10.4: the ramdisk token's holder builds claims with machine Y's
// product UUID and serial (Y's hardware key) and the MAC of machine X,
// which the site booted and vouched for, and joins from X's address. In no
// approval mode does that reclaim Y: the join waits for a person, and Y's
// node keeps its generation and certificate. Once X joined on its vouch,
// even an approval of the forged request admits nothing (vouch-used).
func TestDiscoveryTakeoverRefusedR15_3(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		for i, mode := range []string{tenancy.ApprovalUnknownMachines, tenancy.ApprovalAlways, tenancy.ApprovalNever} {
			t.Run(mode, func(t *testing.T) {
				d := newDiscoIn(t, f, mode)
				yClaims, xClaims := jointest.Claims(40+2*i), jointest.Claims(41+2*i)
				tok := d.token(t, &bcv1.CreateJoinTokenRequest{TenantId: d.root, PoolId: d.pool.Id})
				y := d.mustJoin(t, jointest.NewMachine(t, yClaims), tok.Token, pki.RoleNode).Body.NodeId
				x := boot{xClaims.Macs[0], fmt.Sprintf("10.0.3.%d", 7+i), 1}
				d.vouch(t, d.site.Id, x.mac, x.ip, x.epoch)

				forged := proto.Clone(yClaims).(*agentv1.Claims)
				forged.Macs = []string{x.mac}
				atk := jointest.NewMachine(t, forged)
				df := d.mustDefer(t, d.svc, atk, d.request(t, atk, d.ramdisk, x, time.Time{}))
				d.untouched(t, y, "while the forged join waits")
				if r := d.requestRow(t, df.GetRequestId()); r.MachineKey != "hw:"+nodeHardwareKey(t, d, y) {
					t.Fatalf("the forged join waits on request %+v, want it keyed by Y's hardware key for the person deciding", r)
				}

				// X itself joins on its vouch (by its mode; approved when it waits).
				xm := jointest.NewMachine(t, xClaims)
				if got := d.admitted(t, xm, x).Body.NodeId; got == y {
					t.Fatalf("X joined as Y's node %s", y)
				}
				// A person approves the forged request by mistake: the vouch
				// already admitted X.
				d.decide(t, df.GetRequestId(), 15*time.Minute, time.Now())
				d.refusedOnce(t, d.root, "discovery:vouch-used", func() error {
					_, err := d.joinWith(d.svc, d.request(t, atk, d.ramdisk, x, time.Time{}))
					return err
				})
				d.untouched(t, y, "after the approved forged join")
			})
		}
	})
}

// nodeHardwareKey is the hex of node's stored hardware key.
func nodeHardwareKey(t testing.TB, d *disco, node string) string {
	t.Helper()
	return fmt.Sprintf("%x", d.node(t, node).HardwareKey)
}

// R15.3: a vouch admits one machine. The first admitted on a vouch binds
// it; another machine on the same vouch is refused (vouch-used) and
// leaves no node; the same request again gets its stored answer; the same
// machine with a new key reclaims its own node through an approval; the
// next boot of the NIC (a newer lease epoch) is a new vouch.
func TestDiscoveryVouchAdmitsOneMachineR15_3(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalNever)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		withBootMAC := func(i int) *agentv1.Claims {
			c := jointest.Claims(i)
			c.Macs = []string{boot1.mac}
			return c
		}
		a := jointest.NewMachine(t, withBootMAC(60))
		first := d.request(t, a, d.ramdisk, boot1, time.Time{})
		res, err := d.joinWith(d.svc, first)
		if err != nil {
			t.Fatalf("the first machine on the vouch: %v", err)
		}
		node := a.Verify(t, e.Bundle, res, pki.RoleRamdisk).Body.NodeId

		for _, tc := range []struct {
			name string
			m    *jointest.Machine
		}{
			{"another machine (another hardware key)", jointest.NewMachine(t, withBootMAC(61))},
			{"a machine with only the MAC (an untrusted key: another node)", ramdiskMachine(t, boot1.mac)},
		} {
			t.Run(tc.name, func(t *testing.T) {
				d.refusedOnce(t, d.root, "discovery:vouch-used", func() error {
					_, err := d.joinWith(d.svc, d.request(t, tc.m, d.ramdisk, boot1, time.Time{}))
					return err
				})
			})
		}
		if nodes, left := d.nodes(t, d.root), d.usesLeft(t, d.tokenID); len(nodes) != 1 || nodes[0].ID != node || left != 999 {
			t.Fatalf("nodes %+v and %d uses left, want only %s and 999", nodes, left, node)
		}
		// R4.9: the same request again is answered as before.
		if again, err := d.joinWith(d.svc, first); err != nil || string(again.GetBody()) != string(res.GetBody()) {
			t.Fatalf("the same request again: %v; want the stored answer", err)
		}
		// The same machine with a new key: a reclaim of its own node, which
		// waits for a person even in mode never, then keeps the vouch.
		a2 := jointest.NewMachine(t, a.Claims)
		if got := d.admitted(t, a2, boot1).Body; got.NodeId != node || got.IdentityGeneration != 2 {
			t.Fatalf("the same machine again joined as %s generation %d, want %s generation 2", got.NodeId, got.IdentityGeneration, node)
		}
		// The next boot of the NIC is vouched for anew and admits the other
		// machine.
		next := boot{boot1.mac, boot1.ip, boot1.epoch + 1}
		d.vouch(t, d.site.Id, next.mac, next.ip, next.epoch)
		if got := d.admitted(t, jointest.NewMachine(t, withBootMAC(61)), next).Body.NodeId; got == node {
			t.Fatalf("the other machine on the next boot joined as %s, the first machine's node", got)
		}
	})
}

// R15.3 across two API replicas: 24 distinct machines claiming the vouched
// NIC join at once on one vouch (mode never, so each would be a new node):
// exactly one is admitted, every other one is refused (vouch-used) or
// loses the race, and one node and one spent use remain.
func TestVouchAdmitsOneAcrossReplicasR15_3(t *testing.T) {
	eachReplicaPair(t, discoveryAttestors, func(t *testing.T, p replicaPair) {
		d := newDisco(t, p.e, tenancy.ApprovalNever)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		reqs := make([]*agentv1.JoinRequest, raceGoroutines)
		for i := range reqs {
			c := jointest.Claims(200 + i)
			c.Macs = []string{boot1.mac}
			reqs[i] = d.request(t, jointest.NewMachine(t, c), d.ramdisk, boot1, time.Time{})
		}
		admitted := 0
		for _, o := range p.race(t, reqs) {
			switch {
			case o.err == nil:
				admitted++
			case isRace(t, o.err):
			default:
				jointest.WantRefused(t, o.err)
			}
		}
		if admitted != 1 {
			t.Fatalf("%d machines admitted on one vouch, want exactly 1", admitted)
		}
		if n, left := len(d.nodes(t, d.root)), d.usesLeft(t, d.tokenID); n != 1 || left != 999 {
			t.Fatalf("%d nodes and %d uses left, want 1 and 999", n, left)
		}
		for _, r := range jointest.Reasons(t, p.e.DB, d.root) {
			if r != "discovery:vouch-used" {
				t.Errorf("refusal reason %q, want discovery:vouch-used", r)
			}
		}
	})
}

// R15.3, R11.3: a ramdisk naming a node made ahead for some machine takes
// it only through a person's approval, even in mode never: the ramdisk
// token and a vouch prove a boot, not which node the machine is.
func TestDiscoveryMadeAheadNeedsApprovalR15_3(t *testing.T) {
	apitest.Each(t, discoveryAttestors, func(t *testing.T, e *apitest.Env) {
		d := newDisco(t, e, tenancy.ApprovalNever)
		d.vouch(t, d.site.Id, boot1.mac, boot1.ip, boot1.epoch)
		ahead := ids.New(ids.Node, time.Now())
		if err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			_, err := tx.InsertNode(context.Background(), store.Node{ID: ahead, TenantID: d.pool.OwnerTenantId, SiteID: d.pool.SiteId, PoolID: d.pool.Id,
				Role: pki.RoleNode, State: store.NodePending, Hostname: "made-ahead"})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		m := ramdiskMachine(t, boot1.mac)
		req := d.request(t, m, d.ramdisk, boot1, time.Time{})
		req.NodeId = ahead
		req.SealedToken = jointest.Seal(t, e.Bundle, d.ramdisk, req)
		d.mustDefer(t, d.svc, m, req)
		if n := d.node(t, ahead); n.State != store.NodePending || n.IdentityGeneration != 0 {
			t.Fatalf("the node made ahead was taken without approval: %+v", n)
		}
	})
}
