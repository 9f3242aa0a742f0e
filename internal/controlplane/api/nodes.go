package api

import (
	"context"
	"encoding/hex"
	"encoding/json"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/nodes"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

func nodePB(n store.Node) *bcv1.Node {
	return &bcv1.Node{Id: n.ID, TenantId: n.TenantID, SiteId: n.SiteID, PoolId: n.PoolID, Role: n.Role, State: n.State, StateReason: n.StateReason,
		Connection: n.Connection, LastSeen: tsp(n.LastSeen), IdentityGeneration: int32(n.IdentityGeneration), HardwareKeyTrusted: n.HardwareKeyTrusted, HardwareKey: hex.EncodeToString(n.HardwareKey), EkSha256: hex.EncodeToString(n.EKHash),
		NodeKey: n.NodeKey, Attestor: n.Attestor, Hostname: n.Hostname, Claims: jsonStruct(n.Claims), CreatedAt: ts(n.CreatedAt), UpdatedAt: ts(n.UpdatedAt)}
}

func nodeCertPB(c store.NodeCert) *bcv1.NodeCert {
	var kinds []string
	_ = json.Unmarshal(c.AllowedKinds, &kinds)
	return &bcv1.NodeCert{Serial: c.Serial, IdentityGeneration: int32(c.IdentityGeneration), Role: c.Role, NotBefore: ts(c.NotBefore), NotAfter: ts(c.NotAfter),
		RevokedAt: tsp(c.RevokedAt), RevokeReason: c.RevokeReason, AllowedKinds: kinds}
}

func (o *operator) CreateNode(ctx context.Context, req *connect.Request[bcv1.CreateNodeRequest]) (*connect.Response[bcv1.Node], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	n, err := o.s.nodes.Create(ctx, p, nodes.CreateRequest{TenantID: m.GetTenantId(), PoolID: m.GetPoolId(), Hostname: m.GetHostname(),
		IdempotencyKey: m.GetIdempotencyKey()})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(nodePB(n)), nil
}

func (o *operator) ListNodes(ctx context.Context, req *connect.Request[bcv1.ListNodesRequest]) (*connect.Response[bcv1.ListNodesResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.Node, error) {
		return o.s.nodes.List(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId(), after, limit)
	}, func(x store.Node) string { return x.ID }, nodePB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListNodesResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) GetNode(ctx context.Context, req *connect.Request[bcv1.GetNodeRequest]) (*connect.Response[bcv1.Node], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	d, err := o.s.nodes.Get(ctx, p, req.Msg.GetTenantId(), req.Msg.GetNodeId())
	if err != nil {
		return nil, err
	}
	out := nodePB(d.Node)
	for _, c := range d.Certs {
		out.Certs = append(out.Certs, nodeCertPB(c))
	}
	return connect.NewResponse(out), nil
}
