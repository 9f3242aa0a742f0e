// Package discovery is the discovery attestor (R10.4): a ramdisk (bcd with
// role ramdisk, booted over the network) joins with the site's ramdisk
// token and the boot it was given (MAC, address, lease epoch), and a site
// agent of the token's site must have vouched for exactly that boot over
// its session, from the address the gateway saw it connect from. The
// pool's approval mode then decides whether a new machine waits for a
// person (a join request, R10.1): "unknown-machines" and "always" defer
// it, "never" admits it. A machine that is already a node always waits
// (R15.3): the vouch proves a boot of a NIC, not which machine's claims
// came with it, so only a person lets a ramdisk reclaim a node.
//
// SECURITY: the token proves the caller is software the site booted (it is
// in every boot image, so it proves little); the vouch ties the join to
// one NIC, one lease and one address, and admits one node: the first
// admitted on it binds it (vouch-used for any other). A vouch from another
// site, from an older lease, for another address, or used from another
// peer address is refused, so a ramdisk token copied out of a boot image
// cannot join a machine the site did not just boot, and cannot take over
// an existing node without an approval. The peer address is the gateway's
// word: a compromised gateway can present a ramdisk from elsewhere, still
// only with a ramdisk token and a live, unbound vouch, and still not
// reclaim without an approval.
package discovery

import (
	"context"
	"net/netip"
	"slices"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Name of the attestor.
const Name = wire.AttestorDiscovery

// ReasonVouchMissing is the refusal of a boot no site agent vouched for
// (yet): JoinService waits a bounded time for the vouch before it refuses.
const ReasonVouchMissing = "vouch-missing"

// Attestor admits ramdisks a site agent vouched for.
type Attestor struct{ tokens *jointoken.Attestor }

// New returns the attestor.
func New() *Attestor { return &Attestor{tokens: jointoken.New()} }

// Name implements attest.Attestor.
func (*Attestor) Name() string { return Name }

// Evidence parses and checks a ramdisk's evidence: a permanent MAC among
// its claimed ones, an IP address, a positive lease epoch.
func Evidence(raw []byte, claims hwid.Normalized) (*agentv1.DiscoveryEvidence, string) {
	var ev agentv1.DiscoveryEvidence
	if len(raw) == 0 || proto.Unmarshal(raw, &ev) != nil {
		return nil, "discovery-evidence"
	}
	b, err := hwid.Boot{MAC: ev.GetMac(), IP: ev.GetIp(), LeaseEpoch: ev.GetBootLeaseEpoch(), WorkflowID: ev.GetWorkflowId()}.Check()
	if err != nil {
		return nil, "discovery-evidence"
	}
	if !slices.Contains(claims.MACs(), b.MAC) {
		return nil, "discovery-mac"
	}
	ev.Mac, ev.Ip = b.MAC, b.IP
	return &ev, ""
}

// Admit implements attest.Attestor.
func (a *Attestor) Admit(ctx context.Context, tx *store.Tx, in *attest.Input) (*attest.Admission, error) {
	if in.Role != pki.RoleRamdisk {
		// Discovery admits ramdisks only: the installed OS joins later
		// with a node token (or a node made ahead, --node-id).
		return nil, attest.Refuse("discovery-role", "")
	}
	// The site's ramdisk token: secret, state and role (ramdisk), and
	// its use is spent only when the join is admitted.
	adm, err := a.tokens.Admit(ctx, tx, in)
	if err != nil {
		return nil, err
	}
	tenant := adm.TenantID
	// A machine that is already a node of the tenant (its trusted hardware
	// key) and that the site network-booted is being provisioned again:
	// the ramdisk may reclaim its node (R6.3), but only through a join
	// request a person approved (the Approval below, R15.3).
	adm.AllowReclaim = true
	ev, reason := Evidence(in.Evidence, in.Claims)
	if reason != "" {
		return nil, attest.Refuse(reason, tenant)
	}
	v, reason, err := vouchFor(ctx, tx, tenant, adm.SiteID, ev)
	if err != nil {
		return nil, err
	}
	if reason == "" {
		reason = peerReason(in.PeerAddr, v.IP)
	}
	if reason != "" {
		return nil, attest.Refuse(reason, tenant)
	}
	pool, err := tx.GetPool(ctx, adm.PoolID)
	if err != nil {
		return nil, err
	}
	policy, err := tenancy.ParsePolicy(pool.Policy)
	if err != nil {
		return nil, err
	}
	// R15.3: every mode defers a reclaim; "never" admits a new machine.
	adm.Approval = &attest.Approval{
		MachineKey: attest.MachineKeyFor(in.Key, nil, adm.SiteID, ev.GetMac()),
		MAC:        ev.GetMac(), IP: ev.GetIp(), WorkflowID: ev.GetWorkflowId(), VouchedBy: v.VouchedBy, BootLeaseEpoch: v.LeaseEpoch,
		OnlyReclaims: policy.ApprovalMode() == tenancy.ApprovalNever,
	}
	// R15.3: the vouch admits one node, the first admitted on it.
	site, mac, epoch := adm.SiteID, v.MAC, v.LeaseEpoch
	adm.Bind = func(ctx context.Context, tx *store.Tx, nodeID string) error {
		switch ok, err := tx.BindSiteVouch(ctx, tenant, site, mac, epoch, nodeID); {
		case err != nil:
			return err
		case !ok:
			return attest.Refuse("vouch-used", tenant)
		}
		return nil
	}
	return adm, nil
}

// vouchFor finds the token's site's vouch for the boot in ev, or the
// reason there is none that fits.
func vouchFor(ctx context.Context, tx *store.Tx, tenant, siteID string, ev *agentv1.DiscoveryEvidence) (*store.SiteVouch, string, error) {
	vouches, err := tx.SiteVouchesByMAC(ctx, tenant, ev.GetMac())
	if err != nil {
		return nil, "", err
	}
	var v *store.SiteVouch
	for i := range vouches {
		if vouches[i].SiteID == siteID {
			v = &vouches[i]
		}
	}
	switch {
	case v == nil && len(vouches) > 0:
		return nil, "vouch-site", nil
	case v == nil:
		return nil, ReasonVouchMissing, nil
	case ev.GetBootLeaseEpoch() < v.LeaseEpoch:
		// A newer boot of this NIC was vouched for: this is an old one.
		return nil, "vouch-epoch", nil
	case ev.GetBootLeaseEpoch() > v.LeaseEpoch:
		return nil, ReasonVouchMissing, nil
	case ev.GetIp() != v.IP:
		return nil, "vouch-ip", nil
	}
	return v, "", nil
}

// peerReason is "" when the address the gateway saw the daemon connect
// from (ip:port, or a bare IP) is the vouched IP, else "vouch-peer": the
// boot_ip in the request is the machine's own word, the peer address is
// what binds the join to the booted machine's network position. No
// address (a gateway that forwarded none) is refused too.
func peerReason(peerAddr, vouchedIP string) string {
	var peer netip.Addr
	if ap, err := netip.ParseAddrPort(peerAddr); err == nil {
		peer = ap.Addr()
	} else if a, err := netip.ParseAddr(peerAddr); err == nil {
		peer = a
	}
	want, err := netip.ParseAddr(vouchedIP)
	if !peer.IsValid() || err != nil || peer.Unmap().WithZone("") != want.Unmap() {
		return "vouch-peer"
	}
	return ""
}
