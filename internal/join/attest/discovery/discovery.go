// Package discovery is the discovery attestor (R10.4): a ramdisk (bcd with
// role ramdisk, booted over the network) joins with the site's ramdisk
// token and the boot it was given (MAC, address, lease epoch), and a site
// agent of the token's site must have vouched for exactly that boot over
// its session. The pool's approval mode then decides whether the machine
// waits for a person (a join request, R10.1): "unknown-machines" defers
// machines that are not already a node of the tenant, "always" defers
// every one, "never" admits every vouched machine.
//
// SECURITY: the token proves the caller is software the site booted; the
// vouch ties it to one NIC and one lease. A vouch from another site, from
// an older lease, or for another address is refused, so a ramdisk token
// copied out of one boot image cannot join a machine the site did not
// just boot.
package discovery

import (
	"context"
	"slices"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/hwid"
	"github.com/better-compute/better-compute/internal/join/attest"
	jtattest "github.com/better-compute/better-compute/internal/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/tenancy"
	"github.com/better-compute/better-compute/internal/wire"
)

// Name of the attestor.
const Name = wire.AttestorDiscovery

// Attestor admits ramdisks a site agent vouched for.
type Attestor struct{ tokens *jtattest.Attestor }

// New returns the attestor.
func New() *Attestor { return &Attestor{tokens: jtattest.New()} }

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
	// the ramdisk reclaims its node (R6.3), on the site's vouch below.
	adm.AllowReclaim = true
	ev, reason := Evidence(in.Evidence, in.Claims)
	if reason != "" {
		return nil, attest.Refuse(reason, tenant)
	}
	vouches, err := tx.SiteVouchesByMAC(ctx, tenant, ev.GetMac())
	if err != nil {
		return nil, err
	}
	var v *store.SiteVouch
	for i := range vouches {
		if vouches[i].SiteID == adm.SiteID {
			v = &vouches[i]
		}
	}
	switch {
	case v == nil && len(vouches) > 0:
		return nil, attest.Refuse("vouch-site", tenant)
	case v == nil:
		return nil, attest.Refuse("vouch-missing", tenant)
	case ev.GetBootLeaseEpoch() < v.LeaseEpoch:
		// A newer boot of this NIC was vouched for: this is an old one.
		return nil, attest.Refuse("vouch-epoch", tenant)
	case ev.GetBootLeaseEpoch() > v.LeaseEpoch:
		return nil, attest.Refuse("vouch-missing", tenant)
	case ev.GetIp() != v.IP:
		return nil, attest.Refuse("vouch-ip", tenant)
	}
	pool, err := tx.GetPool(ctx, adm.PoolID)
	if err != nil {
		return nil, err
	}
	policy, err := tenancy.ParsePolicy(pool.Policy)
	if err != nil {
		return nil, err
	}
	if mode := policy.ApprovalMode(); mode != tenancy.ApprovalNever {
		adm.Approval = &attest.Approval{
			MachineKey: attest.MachineKeyFor(in.Key, nil, adm.SiteID, ev.GetMac()),
			MAC:        ev.GetMac(), IP: ev.GetIp(), WorkflowID: ev.GetWorkflowId(), VouchedBy: v.VouchedBy, BootLeaseEpoch: v.LeaseEpoch,
			OnlyUnknown: mode == tenancy.ApprovalUnknownMachines,
		}
	}
	return adm, nil
}
