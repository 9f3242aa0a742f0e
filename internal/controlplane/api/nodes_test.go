package api_test

import (
	"context"
	"strings"
	"testing"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R1.2: NodeService tells a caller without rights nothing
// about which nodes (or pools) exist: a node it may not read answers
// exactly as a missing one, NOT_FOUND "node <id> not found", for get and
// retire; a pool it may not see answers as a missing pool for list. A
// caller who can see a node but lacks the right for an action learns
// ACCESS_DENIED.
func TestNodeServiceNoExistenceLeak(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		a := joinNode(t, e, e.Admin, w.root, w.pool.Id)  // the caller's blind spot
		b := joinNode(t, e, e.Admin, w.root, w.pool2.Id) // the caller's pool
		const missing = "node_01k5w0000000000000000000zz"
		const missingPool = "pool_01k5w0000000000000000000zz"

		// Reads and updates nodes of pool2 only.
		pool2 := e.Client(t, mkKey(t, e.Admin, w.root, "pool2-operator",
			&bcv1.Grant{Action: "compute:nodes:*", Resource: "compute-pool/" + w.pool2.Id}))
		// Reads every node, updates none.
		reader := e.Client(t, mkKey(t, e.Admin, w.root, "reader", &bcv1.Grant{Action: "compute:nodes:read", Resource: "*"}))

		tests := []struct {
			name string
			call func() error
			code errs.Code
			msg  string // the exact message, when the answer is an error
		}{
			{"get: visible node", func() error {
				_, err := pool2.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: b.id}))
				return err
			}, "", ""},
			{"get: existing node without rights", func() error {
				_, err := pool2.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: a.id}))
				return err
			}, errs.NotFound, "node " + a.id + " not found"},
			{"get: missing node", func() error {
				_, err := pool2.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: missing}))
				return err
			}, errs.NotFound, "node " + missing + " not found"},
			{"retire: existing node without rights", func() error {
				_, err := pool2.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: w.root, NodeId: a.id}))
				return err
			}, errs.NotFound, "node " + a.id + " not found"},
			{"retire: missing node", func() error {
				_, err := pool2.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: w.root, NodeId: missing}))
				return err
			}, errs.NotFound, "node " + missing + " not found"},
			{"retire: a node the caller reads but may not update", func() error {
				_, err := reader.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: w.root, NodeId: a.id}))
				return err
			}, errs.AccessDenied, "compute:nodes:update is not allowed on compute-node/" + a.id},
			{"list: visible pool", func() error {
				_, err := pool2.Nodes.ListNodes(ctx, rq(&bcv1.ListNodesRequest{TenantId: w.root, PoolId: w.pool2.Id}))
				return err
			}, "", ""},
			{"list: existing pool without rights", func() error {
				_, err := pool2.Nodes.ListNodes(ctx, rq(&bcv1.ListNodesRequest{TenantId: w.root, PoolId: w.pool.Id}))
				return err
			}, errs.NotFound, "pool " + w.pool.Id + " not found"},
			{"list: missing pool", func() error {
				_, err := pool2.Nodes.ListNodes(ctx, rq(&bcv1.ListNodesRequest{TenantId: w.root, PoolId: missingPool}))
				return err
			}, errs.NotFound, "pool " + missingPool + " not found"},
			{"R1.2 another tenant's node", func() error {
				_, err := w.acmeAdmin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.acme, NodeId: a.id}))
				return err
			}, errs.NotFound, "node " + a.id + " not found"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				err := tc.call()
				if tc.code == "" {
					mustOK(t, err)
					return
				}
				if e := wantErr(t, err, tc.code, ""); e.Message != tc.msg {
					t.Fatalf("message %q, want %q", e.Message, tc.msg)
				}
			})
		}
		// The blind node is untouched by the refused retire.
		n, err := e.Admin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: a.id}))
		mustOK(t, err)
		if strings.Contains(n.Msg.State, "retired") {
			t.Fatalf("node %s was retired by a caller without rights", a.id)
		}
	})
}
