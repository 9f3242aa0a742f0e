package join

import (
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// decide is table-tested without a database: every verdict of the join
// decision, from the situation the admission transaction reads.
func TestDecide(t *testing.T) {
	claims, err := hwid.Normalize(hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8052-b7c04f000001", ProductSerial: "SN-7701", MACs: []string{"00:1b:21:aa:bb:cc"}})
	if err != nil {
		t.Fatal(err)
	}
	placeholder, err := hwid.Normalize(hwid.Claims{ProductSerial: "To Be Filled By O.E.M.", MACs: []string{"00:1b:21:aa:bb:cd"}})
	if err != nil {
		t.Fatal(err)
	}
	pool := store.Pool{ID: "pool_a", OwnerTenantID: "tn_a", SiteID: "site_a", Agent: tenancy.AgentBCD}
	site := store.Site{ID: "site_a", OwnerTenantID: "tn_a"}
	node := func(mod func(*store.Node)) *store.Node {
		n := &store.Node{ID: "node_1", TenantID: "tn_a", SiteID: "site_a", PoolID: "pool_a", Role: pki.RoleNode, State: store.NodeAdopted,
			IdentityGeneration: 3, HardwareKeyTrusted: true, HardwareKey: []byte("hk")}
		if mod != nil {
			mod(n)
		}
		return n
	}
	base := func(mod func(*situation)) situation {
		s := situation{
			Attestor: DefaultAttestor,
			Adm:      &attest.Admission{TenantID: "tn_a", PoolID: "pool_a", Role: pki.RoleNode},
			Pool:     pool, Site: site, Root: "tn_root",
			Claims: claims, Key: claims.Key(),
		}
		if mod != nil {
			mod(&s)
		}
		return s
	}
	for _, tc := range []struct {
		name    string
		s       situation
		reason  string
		outcome outcome
		role    string
		trusted bool
	}{
		{name: "R4.4 a new machine", s: base(nil), outcome: joinNew, role: pki.RoleNode, trusted: true},
		{name: "R4.4 pool of another tenant", s: base(func(s *situation) { s.Pool.OwnerTenantID = "tn_b" }), reason: "pool-tenant"},
		{name: "R4.4 pool without the daemon", s: base(func(s *situation) { s.Pool.Agent = "none" }), reason: "pool-agent"},
		{name: "R6.4 pool not admitting the attestor", s: base(func(s *situation) {
			s.Policy = tenancy.Policy{JoinAttestors: []string{"tpm"}}
		}), reason: "pool-attestor"},
		{name: "R5.1 expect mismatch", s: base(func(s *situation) { s.Adm.Expect = hwid.Expect{Serial: "SN-OTHER"} }), reason: "expect-mismatch"},
		{name: "R5.1 expect match", s: base(func(s *situation) { s.Adm.Expect = hwid.Expect{Serial: "sn-7701"} }), outcome: joinNew, role: pki.RoleNode, trusted: true},
		{name: "R6.2 placeholder hardware", s: base(func(s *situation) { s.Claims, s.Key = placeholder, placeholder.Key() }), reason: "placeholder-hardware"},
		{name: "R6.2 placeholder hardware with an expect binding joins untrusted", s: base(func(s *situation) {
			s.Claims, s.Key = placeholder, placeholder.Key()
			s.Adm.Expect = hwid.Expect{MAC: "00:1b:21:aa:bb:cd"}
		}), outcome: joinNew, role: pki.RoleNode, trusted: false},
		{name: "R6.3 known machine without allowReclaim", s: base(func(s *situation) { s.Existing = node(nil) }), reason: "reclaim"},
		{name: "R6.3 reclaim", s: base(func(s *situation) { s.Existing = node(nil); s.Adm.AllowReclaim = true }), outcome: joinReclaim, role: pki.RoleNode, trusted: true},
		{name: "R6.3 reclaim with a key already issued to the node", s: base(func(s *situation) {
			s.Existing, s.KeyIssued = node(nil), true
			s.Adm.AllowReclaim = true
		}), reason: "reclaim-key-reused"},
		{name: "R6.3 reclaim into another pool", s: base(func(s *situation) {
			s.Existing = node(func(n *store.Node) { n.PoolID = "pool_b" })
			s.Adm.AllowReclaim = true
		}), reason: "reclaim"},
		{name: "R6.3 reclaim for another role", s: base(func(s *situation) {
			s.Existing = node(func(n *store.Node) { n.Role = pki.RoleSite })
			s.Adm.AllowReclaim = true
		}), reason: "reclaim"},
		{name: "R8.2 a reclaim keeps a node-tenant node tenant-controlled", s: base(func(s *situation) {
			s.Existing = node(func(n *store.Node) { n.Role = pki.RoleNodeTenant })
			s.Adm.AllowReclaim = true
		}), outcome: joinReclaim, role: pki.RoleNodeTenant, trusted: true},
		{name: "R8.1 hosted token makes node-tenant", s: base(func(s *situation) { s.Adm.Hosted = "kubernetes" }), outcome: joinNew, role: pki.RoleNodeTenant, trusted: true},
		{name: "R8.1 hosted token in a platform-operated platform pool", s: base(func(s *situation) {
			s.Adm.Hosted, s.Root = "kubernetes", "tn_a"
			s.Policy = tenancy.Policy{Kubernetes: tenancy.Kubernetes{PlatformOperated: true}}
		}), outcome: joinNew, role: pki.RoleNode, trusted: true},
		{name: "R11.3 node id of no node", s: base(func(s *situation) { s.RequestedNodeID = "node_2" }), reason: "node-id-mismatch"},
		{name: "R11.3 node id of the machine's node", s: base(func(s *situation) {
			s.RequestedNodeID, s.Existing = "node_1", node(nil)
			s.Adm.AllowReclaim = true
		}), outcome: joinReclaim, role: pki.RoleNode, trusted: true},
		{name: "R10.4 placeholder hardware a site vouched for joins untrusted", s: base(func(s *situation) {
			s.Attestor, s.Adm.Role = "discovery", pki.RoleRamdisk
			s.Claims, s.Key = placeholder, placeholder.Key()
		}), outcome: joinNew, role: pki.RoleRamdisk, trusted: false},
		{name: "R10.4 a ramdisk reclaims the node its machine is", s: base(func(s *situation) {
			s.Attestor, s.Adm.Role, s.Adm.AllowReclaim = "discovery", pki.RoleRamdisk, true
			s.Existing = node(nil)
		}), outcome: joinReclaim, role: pki.RoleRamdisk, trusted: true},
		{name: "R10.4 a ramdisk of a node-tenant machine stays a ramdisk", s: base(func(s *situation) {
			s.Attestor, s.Adm.Role, s.Adm.AllowReclaim = "discovery", pki.RoleRamdisk, true
			s.Existing = node(func(n *store.Node) { n.Role = pki.RoleNodeTenant })
		}), outcome: joinReclaim, role: pki.RoleRamdisk, trusted: true},
		{name: "R10.4 the installed OS reclaims its ramdisk node", s: base(func(s *situation) {
			s.Adm.AllowReclaim = true
			s.Existing = node(func(n *store.Node) { n.Role = pki.RoleRamdisk })
		}), outcome: joinReclaim, role: pki.RoleNode, trusted: true},
		{name: "R10.4 a ramdisk never takes a site agent", s: base(func(s *situation) {
			s.Attestor, s.Adm.Role, s.Adm.AllowReclaim = "discovery", pki.RoleRamdisk, true
			s.Existing = node(func(n *store.Node) { n.Role = pki.RoleSite })
		}), reason: "reclaim"},
		{name: "R11.3 a node made ahead takes the machine", s: base(func(s *situation) {
			s.RequestedNodeID = "node_9"
			s.Requested = node(func(n *store.Node) {
				n.ID, n.State, n.IdentityGeneration, n.HardwareKey = "node_9", store.NodePending, 0, nil
			})
		}), outcome: joinBind, role: pki.RoleNode, trusted: true},
		{name: "R11.3 a node made ahead in another pool", s: base(func(s *situation) {
			s.RequestedNodeID = "node_9"
			s.Requested = node(func(n *store.Node) { n.ID, n.State, n.PoolID = "node_9", store.NodePending, "pool_b" })
		}), reason: "node-id-pool"},
		{name: "R11.3 a node made ahead of another tenant", s: base(func(s *situation) {
			s.RequestedNodeID = "node_9"
			s.Requested = node(func(n *store.Node) { n.ID, n.State, n.TenantID = "node_9", store.NodePending, "tn_b" })
		}), reason: "node-id-pool"},
		{name: "R11.3 a node made ahead for a machine that already is a node", s: base(func(s *situation) {
			s.RequestedNodeID, s.Existing = "node_9", node(nil)
			s.Requested = node(func(n *store.Node) { n.ID, n.State = "node_9", store.NodePending })
		}), reason: "node-id-mismatch"},
		{name: "R10.5 re-join", s: base(func(s *situation) {
			s.Attestor, s.Adm.NodeID, s.RequestedNodeID = "x509pop", "node_1", "node_1"
			s.Existing = node(nil)
			s.Claims, s.Key = placeholder, placeholder.Key() // claims do not decide a re-join
		}), outcome: joinRejoin, role: pki.RoleNode, trusted: true},
		{name: "R10.5 re-join of a retired node", s: base(func(s *situation) {
			s.Attestor, s.Adm.NodeID = "x509pop", "node_1"
			s.Existing = node(func(n *store.Node) { n.State = store.NodeRetired })
		}), reason: "rejoin"},
		{name: "R10.5 re-join with a key issued before", s: base(func(s *situation) {
			s.Attestor, s.Adm.NodeID = "x509pop", "node_1"
			s.Existing, s.KeyIssued = node(nil), true
		}), reason: "rejoin-key-reused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, reason := decide(tc.s)
			if reason != tc.reason {
				t.Fatalf("reason %q, want %q", reason, tc.reason)
			}
			if reason != "" {
				return
			}
			if d.Outcome != tc.outcome || d.Role != tc.role || d.Trusted != tc.trusted {
				t.Errorf("decision %+v, want outcome %d role %s trusted %v", d, tc.outcome, tc.role, tc.trusted)
			}
			if tc.outcome == joinBind && d.NodeID != "node_9" {
				t.Errorf("bound node %q, want node_9", d.NodeID)
			}
			if (d.Outcome == joinNew) != (d.NodeID == "") {
				t.Errorf("node id %q for outcome %d", d.NodeID, d.Outcome)
			}
		})
	}
}
