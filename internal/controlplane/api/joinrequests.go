package api

import (
	"context"
	"encoding/hex"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// joinRequestPB shows a request with every field of R10.2; its State is
// the one the service computed on read (an approval that ran out shows as
// expired).
func joinRequestPB(r store.JoinRequest) *bcv1.JoinRequest {
	return &bcv1.JoinRequest{Id: r.ID, PoolId: r.PoolID, SiteId: r.SiteID, Attestor: r.Attestor, Claims: jsonStruct(r.Claims),
		HardwareKey: hex.EncodeToString(r.HardwareKey), Mac: r.MAC, Ip: r.IP, WorkflowId: r.WorkflowID, VouchedBy: r.VouchedBy,
		BootLeaseEpoch: r.BootLeaseEpoch, CsrSha256: hex.EncodeToString(r.CSRSHA256), State: r.State, CreatedAt: ts(r.CreatedAt),
		UpdatedAt: ts(r.UpdatedAt), DecidedAt: tsp(r.DecidedAt), DecidedBy: r.DecidedBy, Reason: r.Reason, ApprovedUntil: tsp(r.ApprovedUntil),
		ConsumedAt: tsp(r.ConsumedAt), NodeId: r.NodeID}
}

func (o *operator) ListJoinRequests(ctx context.Context, req *connect.Request[bcv1.ListJoinRequestsRequest]) (*connect.Response[bcv1.ListJoinRequestsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	limit, after, err := pageArgs(m.GetPageSize(), m.GetPageToken())
	if err != nil {
		return nil, err
	}
	items, err := o.s.joinReqs.List(ctx, p, m.GetTenantId(), m.GetPoolId(), m.GetState(), after, limit)
	if err != nil {
		return nil, err
	}
	out := &bcv1.ListJoinRequestsResponse{NextPageToken: next(items, limit, func(r store.JoinRequest) string { return r.ID })}
	for _, r := range items {
		out.Items = append(out.Items, joinRequestPB(r))
	}
	return connect.NewResponse(out), nil
}

func (o *operator) ApproveJoinRequest(ctx context.Context, req *connect.Request[bcv1.ApproveJoinRequestRequest]) (*connect.Response[bcv1.JoinRequest], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	r, err := o.s.joinReqs.Approve(ctx, p, m.GetTenantId(), m.GetPoolId(), m.GetRequestId(), time.Duration(m.GetTtlSeconds())*time.Second, m.GetReason())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(joinRequestPB(r)), nil
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
	return connect.NewResponse(joinRequestPB(r)), nil
}
