package api_test

import (
	"context"
	"strings"
	"testing"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// nodes.create makes a node ahead of its machine: pending
// at identity generation 0, listed and read like any node, decided on the
// pool (compute:nodes:create), with node.created and an audit row;
// idempotent by key; NOT_FOUND across tenants.
func TestCreateNodeAhead(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		mk := func(r *bcv1.CreateNodeRequest) (*bcv1.Node, error) {
			res, err := e.Admin.Nodes.CreateNode(ctx, rq(r))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		}
		n, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id, Hostname: "gpu-07", IdempotencyKey: "deploy-7"})
		mustOK(t, err)
		if !strings.HasPrefix(n.Id, "node_") || n.State != "pending" || n.IdentityGeneration != 0 || n.Hostname != "gpu-07" || n.PoolId != w.pool.Id ||
			n.SiteId != w.site.Id || n.Role != "node" || n.Attestor != "" || n.NodeKey != "" || n.HardwareKeyTrusted || n.Connection != "disconnected" {
			t.Fatalf("created %v", n)
		}
		got, err := e.Admin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: n.Id}))
		mustOK(t, err)
		if got.Msg.State != "pending" || len(got.Msg.Certs) != 0 {
			t.Fatalf("read back %v", got.Msg)
		}
		list, err := e.Admin.Nodes.ListNodes(ctx, rq(&bcv1.ListNodesRequest{TenantId: w.root, PoolId: w.pool.Id}))
		mustOK(t, err)
		if len(list.Msg.Items) != 1 || list.Msg.Items[0].Id != n.Id {
			t.Fatalf("listed %v", list.Msg.Items)
		}
		evs, _ := eventsAfter(t, e.Admin, w.root, "", isEvent("node.created", n.Id))
		for _, ev := range evs {
			if ev.Type == "node.created" {
				d := ev.Data.AsMap()
				if d["nodeId"] != n.Id || d["poolId"] != w.pool.Id || d["hostname"] != "gpu-07" || d["state"] != "pending" || d["createdBy"] == "" {
					t.Fatalf("node.created data %v", d)
				}
			}
		}
		audits := 0
		for _, a := range auditAll(t, e.Admin, w.root) {
			if a.Action == "node.created" && a.Resource == "compute-node/"+n.Id {
				audits++
			}
		}
		if audits != 1 {
			t.Fatalf("%d node.created audit rows", audits)
		}

		// The same key again answers the same node, writing nothing.
		again, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id, Hostname: "gpu-07", IdempotencyKey: "deploy-7"})
		mustOK(t, err)
		if again.Id != n.Id {
			t.Fatalf("replay made %s, want %s", again.Id, n.Id)
		}
		// The same key with another hostname, or another pool: CONFLICT;
		// another pool's answer names nothing of the first.
		_, err = mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id, Hostname: "gpu-08", IdempotencyKey: "deploy-7"})
		wantErr(t, err, errs.Conflict, "")
		_, err = mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool2.Id, IdempotencyKey: "deploy-7"})
		if e := wantErr(t, err, errs.Conflict, ""); strings.Contains(e.Message, n.Id) || strings.Contains(e.Message, w.pool.Id) {
			t.Fatalf("conflict names the other pool's node: %s", e.Message)
		}

		pool2 := e.Client(t, mkKey(t, e.Admin, w.root, "pool2-creator", &bcv1.Grant{Action: "compute:nodes:create", Resource: "compute-pool/" + w.pool2.Id}))
		_, err = pool2.Nodes.CreateNode(ctx, rq(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool2.Id}))
		mustOK(t, err)
		const missingPool = "pool_01k5w0000000000000000000zz"
		for _, tc := range []struct {
			name  string
			call  func() error
			code  errs.Code
			field string
		}{
			{"no grant on the pool", func() error {
				_, err := pool2.Nodes.CreateNode(ctx, rq(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id}))
				return err
			}, errs.AccessDenied, ""},
			{"R1.2 another tenant's pool", func() error {
				_, err := w.acmeAdmin.Nodes.CreateNode(ctx, rq(&bcv1.CreateNodeRequest{TenantId: w.acme, PoolId: w.pool.Id}))
				return err
			}, errs.NotFound, ""},
			{"R1.2 another tenant", func() error {
				_, err := w.acmeAdmin.Nodes.CreateNode(ctx, rq(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id}))
				return err
			}, errs.NotFound, ""},
			{"missing pool", func() error { _, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: missingPool}); return err }, errs.NotFound, ""},
			{"no pool", func() error { _, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root}); return err }, errs.InvalidArgument, "poolId"},
			{"a pool without a daemon", func() error {
				_, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.noAgent.Id})
				return err
			}, errs.InvalidState, ""},
			{"bad hostname", func() error {
				_, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id, Hostname: "gpu 07\x1b[2J"})
				return err
			}, errs.InvalidArgument, "hostname"},
			{"bad key", func() error {
				_, err := mk(&bcv1.CreateNodeRequest{TenantId: w.root, PoolId: w.pool.Id, IdempotencyKey: "a b"})
				return err
			}, errs.InvalidArgument, "idempotencyKey"},
		} {
			t.Run(tc.name, func(t *testing.T) { wantErr(t, tc.call(), tc.code, tc.field) })
		}

		// A pending node has no certificate: no command reaches it, and
		// retiring it just retires it.
		_, err = e.Admin.Commands.EnqueueCommand(ctx, rq(&bcv1.EnqueueCommandRequest{TenantId: w.root, NodeId: n.Id, Kind: "node.facts"}))
		wantErr(t, err, errs.InvalidState, "")
		ret, err := e.Admin.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: w.root, NodeId: n.Id}))
		mustOK(t, err)
		if ret.Msg.State != "retired" {
			t.Fatalf("retired %v", ret.Msg)
		}
	})
}
