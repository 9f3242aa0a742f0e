package api

import (
	"context"
	"encoding/hex"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
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
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.JoinRequest, error) {
		return o.s.joinReqs.List(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId(), req.Msg.GetState(), after, limit)
	}, func(x store.JoinRequest) string { return x.ID }, joinRequestPB)
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
