package run_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/apitest"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/wire"
)

// R12.3 end to end: a command the operator API enqueues is delivered over
// the node's live session (signed, verified by bcd), runs, and its answer
// becomes the command's result. R13.2: retiring the node ends that session
// and every later one is refused (node-retired).
func TestR12_3OperatorCommandThenRetire(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		h := newHarness(t, e)
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 40, 6)
		h.start(t, m)
		h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })

		res, err := e.Admin.Commands.EnqueueCommand(ctx, rq(&bcv1.EnqueueCommandRequest{TenantId: e.RootTenant, NodeId: m.nodeID, Kind: "node.facts"}))
		if err != nil {
			t.Fatal(err)
		}
		var cmd *bcv1.Command
		deadline := time.Now().Add(15 * time.Second)
		for {
			got, err := e.Admin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: e.RootTenant, CommandId: res.Msg.Id}))
			if err != nil {
				t.Fatal(err)
			}
			cmd = got.Msg
			if cmd.State != store.CommandQueued && cmd.State != store.CommandSent {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("command still %s", cmd.State)
			}
			time.Sleep(20 * time.Millisecond)
		}
		if cmd.State != store.CommandDone || cmd.SentAt == nil || cmd.DoneAt == nil {
			t.Fatalf("command %s %q (sent %v, done %v)", cmd.State, cmd.Error, cmd.SentAt, cmd.DoneAt)
		}
		facts := cmd.Result.AsMap()
		if facts["cpus"] != float64(6) || facts["gpus"] != float64(1) || facts["memoryBytes"] != float64(16318480*1024) {
			t.Errorf("node.facts result %v", facts)
		}

		// Retire: the live session ends and the node stays out.
		if _, err := e.Admin.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: e.RootTenant, NodeId: m.nodeID, Reason: "test"})); err != nil {
			t.Fatal(err)
		}
		h.waitNode(t, m.nodeID, "disconnected after retire", func(n store.Node) bool { return n.Connection == store.Disconnected })
		_, err = h.dial(t, m.tlsCert())
		if pe, ok := errs.As(wire.FromWire(err)); !ok || pe.Code != errs.AccessDenied || pe.Message != "Session refused" {
			t.Fatalf("session of a retired node: %v", err)
		}
		found := false
		for _, ev := range h.events(t, "security.session.refused") {
			var d map[string]any
			_ = json.Unmarshal(ev.Data, &d)
			if d["nodeId"] == m.nodeID && (d["reason"] == "node-retired") {
				found = true
			}
		}
		if !found {
			t.Error("no security.session.refused event with reason node-retired")
		}
		// bcd keeps retrying with backoff and is refused each time.
		time.Sleep(300 * time.Millisecond)
		if n := h.node(t, m.nodeID); n.Connection != store.Disconnected || n.State != store.NodeRetired {
			t.Errorf("retired node is %s/%s", n.State, n.Connection)
		}
	})
}
