// Package joinreq owns join requests (R10): a join a deferring attestor
// sent to a person, listed, approved for one join or rejected.
package joinreq

import (
	"encoding/hex"
	"encoding/json"

	"github.com/better-compute/better-compute/internal/store"
)

// Published is the data of every security.join-request.* event and audit
// row (created, refreshed, approved, rejected): what the attestor saw and
// the decision so far. It is the one place that data is built.
func Published(r store.JoinRequest) map[string]any {
	d := map[string]any{
		"requestId": r.ID, "poolId": r.PoolID, "siteId": r.SiteID, "attestor": r.Attestor, "role": r.Role, "state": r.State,
		"mac": r.MAC, "ip": r.IP, "workflowId": r.WorkflowID, "vouchedBy": r.VouchedBy, "bootLeaseEpoch": r.BootLeaseEpoch,
		"hardwareKey": hex.EncodeToString(r.HardwareKey), "ekSha256": hex.EncodeToString(r.EKHash), "csrSha256": hex.EncodeToString(r.CSRSHA256),
	}
	if len(r.Claims) > 0 {
		d["claims"] = json.RawMessage(r.Claims)
	}
	if r.DecidedBy != "" {
		d["decidedBy"], d["reason"] = r.DecidedBy, r.Reason
	}
	if r.NodeID != "" {
		d["nodeId"] = r.NodeID
	}
	return d
}
