package join

import (
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// outcome is what an admitted join does to the node table.
type outcome int

const (
	// joinNew inserts a node, identity generation 1.
	joinNew outcome = iota + 1
	// joinReclaim moves a trusted hardware key's node to a new key (R6.3).
	joinReclaim
	// joinRejoin re-joins the node an attestor named (x509pop, R10.5).
	joinRejoin
	// joinBind binds the machine to a node made ahead of it (R11.3).
	joinBind
)

// situation is everything a join decision depends on, read before it: the
// attestor's admission, the pool it names, and the node the machine
// already is, if any. decide needs no database.
type situation struct {
	Attestor string
	Adm      *attest.Admission
	Pool     store.Pool
	Site     store.Site
	Policy   tenancy.Policy
	// Root is the root tenant's id ("" before bootstrap).
	Root   string
	Claims hwid.Normalized
	Key    hwid.HardwareKey
	// RequestedNodeID is the node a deploy created for this machine
	// (R11.3), "" when none.
	RequestedNodeID string
	// Requested is that node when it is still pending (made ahead of its
	// machine, no identity yet); nil otherwise.
	Requested *store.Node
	// Existing is the node this machine already is: the node the attestor
	// named (Adm.NodeID), or the token tenant's live node holding the same
	// trusted hardware key. nil: none.
	Existing *store.Node
	// KeyIssued says the CSR's key was certified for Existing before.
	KeyIssued bool
}

// decision is an admitted join.
type decision struct {
	Outcome outcome
	// Role is the certificate's role (R8).
	Role string
	// Trusted says the node's hardware key is trusted; HardwareKey is what
	// the node row records.
	Trusted     bool
	HardwareKey []byte
	// NodeID is the existing node's id (reclaim, rejoin); "" for a new
	// node.
	NodeID string
}

// decide is the join decision (R4.4, R5, R6, R8, R10.5, R11.3): admit as a
// new node, a reclaim or a re-join, or refuse with a reason. It is pure:
// the admission transaction reads what it needs, then applies the verdict.
func decide(s situation) (decision, string) {
	adm, pool := s.Adm, s.Pool
	switch {
	case pool.OwnerTenantID != adm.TenantID:
		return decision{}, "pool-tenant"
	case pool.Agent != tenancy.AgentBCD:
		return decision{}, "pool-agent"
	case !s.Policy.AllowsAttestor(s.Attestor):
		return decision{}, "pool-attestor"
	}
	// R10.5: an admission naming a node re-joins it. The attestor named
	// the node from a certificate JoinService issued to it, so the expect
	// binding, the placeholder rule and the hardware-key reclaim rules do
	// not apply: they decide which node a machine's claims make it, and
	// the certificate already decided that. The node keeps its key.
	rejoin := adm.NodeID != ""
	if !rejoin {
		// R5: the expect binding; a mismatch spends nothing.
		if !adm.Expect.Empty() && !adm.Expect.Matches(s.Claims) {
			return decision{}, "expect-mismatch"
		}
		// R6.2: placeholder hardware needs an expect binding on a token
		// join; other attestors (a site's vouch, a person's approval)
		// admit it with an untrusted key.
		if s.Attestor == DefaultAttestor && s.Key.PlaceholderHardware() && adm.Expect.Empty() {
			return decision{}, "placeholder-hardware"
		}
	}
	d := decision{Role: certRole(adm, s.Policy, pool, s.Site, s.Root)}
	// Placeholder hardware admitted by an expect binding joins with an
	// untrusted key (R6.2), so it never reclaims: a key of two kinds
	// without a product UUID or serial (e.g. MAC + GPU) is trusted by hwid
	// but not here.
	d.Trusted = s.Key.Trusted && !s.Key.PlaceholderHardware()
	if d.Trusted {
		d.HardwareKey = s.Key.Hash[:]
	}
	ex := s.Existing
	if rejoin && ex == nil {
		return decision{}, "rejoin"
	}
	// R11.3: a node made ahead of its machine takes the machine, once,
	// in its own tenant and pool; any other node id must be the node this
	// machine is.
	if r := s.Requested; !rejoin && r != nil && r.ID == s.RequestedNodeID {
		switch {
		case ex != nil:
			// The machine already is another node.
			return decision{}, "node-id-mismatch"
		case r.TenantID != adm.TenantID || r.PoolID != pool.ID:
			return decision{}, "node-id-pool"
		}
		d.Outcome, d.NodeID = joinBind, r.ID
		return d, ""
	}
	if want := s.RequestedNodeID; want != "" && (ex == nil || ex.ID != want) {
		return decision{}, "node-id-mismatch"
	}
	same := func(n *store.Node) bool {
		return n.TenantID == adm.TenantID && n.SiteID == pool.SiteID && n.PoolID == pool.ID && sameMachineRole(n.Role, d.Role, rejoin)
	}
	switch {
	case rejoin:
		if ex.State == store.NodeRetired || !same(ex) {
			return decision{}, "rejoin"
		}
		if s.KeyIssued {
			// A key from before (a backup, an older certificate) never
			// comes back as the node's identity.
			return decision{}, "rejoin-key-reused"
		}
		d.Outcome, d.NodeID = joinRejoin, ex.ID
		d.Trusted, d.HardwareKey = ex.HardwareKeyTrusted, ex.HardwareKey
	case ex != nil:
		// R6.3: a trusted key that already belongs to a node is a reclaim.
		if !adm.AllowReclaim || !same(ex) {
			return decision{}, "reclaim"
		}
		// A reclaim moves the node to a new key: one already issued to it
		// is a replay or a restored backup, never a new machine identity.
		if s.KeyIssued {
			return decision{}, "reclaim-key-reused"
		}
		// A reclaim only ever lowers trust: a node made tenant-controlled
		// by a hosted token stays so (R8.2).
		if ex.Role == pki.RoleNodeTenant && d.Role == pki.RoleNode {
			d.Role = pki.RoleNodeTenant
		}
		d.Outcome, d.NodeID = joinReclaim, ex.ID
	default:
		d.Outcome = joinNew
	}
	return d, ""
}

// sameMachineRole says whether a node of role from may become role to when
// its machine joins again. A re-join keeps the node's role family; a
// reclaim may also move a node into a ramdisk (the machine network-booted
// for provisioning, R10.4) and a ramdisk back into a node (its installed
// OS joined): one machine stays one node. A site agent stays a site agent.
func sameMachineRole(from, to string, rejoin bool) bool {
	f, t := nodeident.Family(from), nodeident.Family(to)
	if f == t {
		return true
	}
	provisioning := func(r string) bool { return r == pki.RoleNode || r == pki.RoleRamdisk }
	return !rejoin && provisioning(f) && provisioning(t)
}

// certRole decides the certificate's role (R8): a hosted token makes a
// tenant-controlled node-tenant, unless the pool is platform-operated and
// owned by the platform. The token decides, never the machine's claims.
func certRole(adm *attest.Admission, policy tenancy.Policy, pool store.Pool, site store.Site, root string) string {
	if adm.Hosted == "" || adm.Role != pki.RoleNode {
		return adm.Role
	}
	platformOwned := pool.OwnerTenantID == site.OwnerTenantID && !site.Custom && (root == "" || pool.OwnerTenantID == root)
	if policy.Kubernetes.PlatformOperated && platformOwned {
		return pki.RoleNode
	}
	return pki.RoleNodeTenant
}
