package api

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/joinreq"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// joinRequestPB shows a request with every field of R10.2, its evidence
// apart from its claims (R22.1), and its effect and version (R22.2); its
// State is the one the service computed on read (an approval that ran out
// shows as expired).
func joinRequestPB(v joinreq.View) *bcv1.JoinRequest {
	r := v.JoinRequest
	return &bcv1.JoinRequest{Id: r.ID, PoolId: r.PoolID, SiteId: r.SiteID, Attestor: r.Attestor, Claims: jsonStruct(r.Claims),
		HardwareKey: hex.EncodeToString(r.HardwareKey), Mac: r.MAC, Ip: r.IP, WorkflowId: r.WorkflowID, VouchedBy: r.VouchedBy,
		BootLeaseEpoch: r.BootLeaseEpoch, CsrSha256: hex.EncodeToString(r.CSRSHA256), State: r.State, CreatedAt: ts(r.CreatedAt),
		UpdatedAt: ts(r.UpdatedAt), DecidedAt: tsp(r.DecidedAt), DecidedBy: r.DecidedBy, Reason: r.Reason, ApprovedUntil: tsp(r.ApprovedUntil),
		ConsumedAt: tsp(r.ConsumedAt), NodeId: r.NodeID, Evidence: evidencePB(r), Effect: effectPB(v), Version: joinreq.Version(r),
		AcknowledgedReclaimNodeId: r.AcknowledgedNodeID}
}

// evidencePB is what the request's attestor established (R22.1).
func evidencePB(r store.JoinRequest) *bcv1.JoinRequestEvidence {
	e := &bcv1.JoinRequestEvidence{PeerAddress: r.Source}
	if len(r.EKHash) > 0 || r.EKCert != "" {
		e.EkSha256, e.AkName = hex.EncodeToString(r.EKHash), hex.EncodeToString(r.AKName)
		e.EkCertificatePresent = r.EKCert == store.EKCertUntrusted || r.EKCert == store.EKCertTrusted
		e.EkCertificateTrusted = r.EKCert == store.EKCertTrusted
		e.EkCertificateSubject, e.EkCertificateIssuer = r.EKCertSubject, r.EKCertIssuer
	}
	if r.VouchedBy != "" {
		e.VouchedBy, e.BootLeaseEpoch, e.VouchedIp, e.VouchedMac, e.WorkflowId = r.VouchedBy, r.BootLeaseEpoch, r.IP, r.MAC, r.WorkflowID
	}
	return e
}

// effectPB is what approving the request does (R22.2), with the node it
// takes as recorded now.
func effectPB(v joinreq.View) *bcv1.JoinRequestEffect {
	e := &bcv1.JoinRequestEffect{Kind: v.Effect, SameClaimsRequestIds: v.SameClaims}
	if n := v.Node; n != nil {
		var c hwid.Claims
		_ = json.Unmarshal(n.Claims, &c) // stored by JoinService; an unreadable row shows no identifiers
		e.Node = &bcv1.JoinRequestNode{Id: n.ID, Role: n.Role, State: n.State, IdentityGeneration: int32(n.IdentityGeneration),
			LastSeenAt: tsp(n.LastSeen), Hostname: n.Hostname, ProductUuid: c.ProductUUID, Serials: serials(c), Macs: c.MACs,
			HardwareKey: hex.EncodeToString(n.HardwareKey), Attestor: n.Attestor}
	} else if v.EffectNodeID != "" {
		e.Node = &bcv1.JoinRequestNode{Id: v.EffectNodeID}
	}
	return e
}

// serials are the claims' non-empty serials: product, board, chassis.
func serials(c hwid.Claims) []string {
	var out []string
	for _, s := range []string{c.ProductSerial, c.BoardSerial, c.ChassisSerial} {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

func (o *operator) GetJoinRequest(ctx context.Context, req *connect.Request[bcv1.GetJoinRequestRequest]) (*connect.Response[bcv1.JoinRequest], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	v, err := o.s.joinReqs.Get(ctx, p, m.GetTenantId(), m.GetPoolId(), m.GetRequestId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(joinRequestPB(v)), nil
}

func (o *operator) ListJoinRequests(ctx context.Context, req *connect.Request[bcv1.ListJoinRequestsRequest]) (*connect.Response[bcv1.ListJoinRequestsResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]joinreq.View, error) {
		return o.s.joinReqs.List(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId(), req.Msg.GetState(), after, limit)
	}, func(x joinreq.View) string { return x.ID }, joinRequestPB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListJoinRequestsResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) ApproveJoinRequest(ctx context.Context, req *connect.Request[bcv1.ApproveJoinRequestRequest]) (*connect.Response[bcv1.JoinRequest], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	r, err := o.s.joinReqs.Approve(ctx, p, m.GetTenantId(), m.GetPoolId(), m.GetRequestId(), joinreq.Approval{
		TTL: time.Duration(m.GetTtlSeconds()) * time.Second, Reason: m.GetReason(),
		Version: m.GetVersion(), AcknowledgeReclaimNodeID: m.GetAcknowledgeReclaimNodeId(),
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(joinRequestPB(joinreq.View{JoinRequest: r})), nil
}

func (o *operator) RejectJoinRequest(ctx context.Context, req *connect.Request[bcv1.RejectJoinRequestRequest]) (*connect.Response[bcv1.JoinRequest], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	r, err := o.s.joinReqs.Reject(ctx, p, m.GetTenantId(), m.GetPoolId(), m.GetRequestId(), m.GetReason())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(joinRequestPB(joinreq.View{JoinRequest: r})), nil
}
