package session

import (
	"context"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// MaxBootedPerReport bounds the machines of one site report.
const MaxBootedPerReport = 1000

// Refusal reasons of site reports; each ends the session.
const (
	// reasonSiteReportRole: a node that is not a site agent reported.
	reasonSiteReportRole = "site-report-role"
	// reasonSiteReportSignature: the report is not signed by the session's
	// key over its nonce, or repeats an earlier sequence number.
	reasonSiteReportSignature = "site-report-signature"
	// reasonSiteReportInvalid: a machine's MAC, address or lease epoch is
	// not valid, or the report is too long.
	reasonSiteReportInvalid = "site-report-invalid"
)

// siteReport records a site agent's vouches for the machines it booted
// (R10.4), for its own site, as the session's node. A vouch never moves
// back to an older lease epoch (store.UpsertSiteVouch).
func (s *Service) siteReport(ctx context.Context, c *conn, r *agentv1.SiteReport) error {
	refuse := func(reason string) error {
		return &refusal{reason: reason, tenantID: c.tenantID, nodeID: c.nodeID, serial: c.serial}
	}
	if c.role != pki.RoleSite {
		return refuse(reasonSiteReportRole)
	}
	var body agentv1.SiteReportBody
	if pki.VerifySiteReport(c.nodeKey, c.nonce, r.GetBody(), r.GetSig()) != nil || proto.Unmarshal(r.GetBody(), &body) != nil || body.GetSeq() <= c.lastReport {
		return refuse(reasonSiteReportSignature)
	}
	c.lastReport = body.GetSeq()
	if len(body.GetMachines()) > MaxBootedPerReport {
		return refuse(reasonSiteReportInvalid)
	}
	vouches := make([]store.SiteVouch, 0, len(body.GetMachines()))
	for _, m := range body.GetMachines() {
		b, err := hwid.Boot{MAC: m.GetMac(), IP: m.GetIp(), LeaseEpoch: m.GetLeaseEpoch(), WorkflowID: m.GetWorkflowId()}.Check()
		if err != nil {
			return refuse(reasonSiteReportInvalid)
		}
		vouches = append(vouches, store.SiteVouch{TenantID: c.tenantID, SiteID: c.siteID, MAC: b.MAC, IP: b.IP,
			LeaseEpoch: b.LeaseEpoch, VouchedBy: c.nodeID, WorkflowID: b.WorkflowID})
	}
	if len(vouches) == 0 {
		return nil
	}
	return s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		var macs []string
		for _, v := range vouches {
			changed, err := tx.UpsertSiteVouch(ctx, v)
			if err != nil {
				return err
			}
			if changed {
				macs = append(macs, v.MAC)
			}
		}
		if len(macs) == 0 {
			return nil
		}
		return events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: c.tenantID, Type: "site.machines-vouched", Subject: c.nodeID,
			Data: map[string]any{"siteId": c.siteID, "vouchedBy": c.nodeID, "macs": macs}})
	})
}
