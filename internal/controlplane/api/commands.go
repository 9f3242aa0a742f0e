package api

import (
	"context"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/structpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/commands"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Commands exposes the command queue (server.Run sweeps expired commands
// with it; tests expire on demand).
func (s *Server) Commands() *commands.Service { return s.commands }

func commandPB(c store.Command) *bcv1.Command {
	out := &bcv1.Command{Id: c.ID, NodeId: c.NodeID, Kind: c.Kind, Args: jsonStruct(c.Args), State: c.State, Error: c.Error,
		CreatedAt: ts(c.CreatedAt), SentAt: tsp(c.SentAt), DoneAt: tsp(c.FinishedAt), ExpiresAt: ts(c.ExpiresAt)}
	if len(c.Result) > 0 {
		out.Result = jsonStruct(c.Result)
	}
	return out
}

func argsJSON(s *structpb.Struct) ([]byte, error) {
	if s == nil {
		return nil, nil
	}
	b, err := protojson.Marshal(s)
	if err != nil {
		return nil, errs.Invalid("args", "not a JSON object")
	}
	return b, nil
}

func (o *operator) EnqueueCommand(ctx context.Context, req *connect.Request[bcv1.EnqueueCommandRequest]) (*connect.Response[bcv1.Command], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	args, err := argsJSON(m.GetArgs())
	if err != nil {
		return nil, err
	}
	if m.GetTtlSeconds() < 0 {
		return nil, errs.Invalid("ttlSeconds", "cannot be negative")
	}
	c, err := o.s.commands.Enqueue(ctx, p, m.GetTenantId(), m.GetNodeId(), m.GetKind(), args, time.Duration(m.GetTtlSeconds())*time.Second)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(commandPB(c)), nil
}

func (o *operator) GetCommand(ctx context.Context, req *connect.Request[bcv1.GetCommandRequest]) (*connect.Response[bcv1.Command], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	c, err := o.s.commands.Get(ctx, p, req.Msg.GetTenantId(), req.Msg.GetCommandId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(commandPB(c)), nil
}

func (o *operator) ListCommands(ctx context.Context, req *connect.Request[bcv1.ListCommandsRequest]) (*connect.Response[bcv1.ListCommandsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	limit, err := page("pageSize", req.Msg.GetPageSize())
	if err != nil {
		return nil, err
	}
	after, err := pageToken(req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	items, err := o.s.commands.List(ctx, p, req.Msg.GetTenantId(), req.Msg.GetNodeId(), after, limit)
	if err != nil {
		return nil, err
	}
	out := &bcv1.ListCommandsResponse{NextPageToken: next(items, limit, func(c store.Command) string { return c.ID })}
	for _, c := range items {
		out.Items = append(out.Items, commandPB(c))
	}
	return connect.NewResponse(out), nil
}

func (o *operator) RetireNode(ctx context.Context, req *connect.Request[bcv1.RetireNodeRequest]) (*connect.Response[bcv1.Node], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	n, err := o.s.nodes.Retire(ctx, p, req.Msg.GetTenantId(), req.Msg.GetNodeId(), req.Msg.GetReason())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(nodePB(n)), nil
}
