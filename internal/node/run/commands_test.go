package run_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R12.3 end to end: a command the operator API enqueues is delivered over
// the node's live session (signed, verified by bcd), runs, and its signed
// answer becomes the command's result, audited (R14.2). R12.1, R13.2:
// retiring the node ends that session at once (pushed, no clock moved),
// bcd stops with ErrRetired instead of reconnecting, and every later
// session is refused (node-retired).
func TestR12_3OperatorCommandThenRetire(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 40, 6)
		p := h.start(t, m)
		h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })

		id := h.enqueue(t, m.nodeID)
		h.waitCommand(t, id)
		got, err := h.e.Admin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: h.e.RootTenant, CommandId: id}))
		if err != nil {
			t.Fatal(err)
		}
		cmd := got.Msg
		if cmd.State != store.CommandDone || cmd.SentAt == nil || cmd.DoneAt == nil {
			t.Fatalf("command %s %q (sent %v, done %v)", cmd.State, cmd.Error, cmd.SentAt, cmd.DoneAt)
		}
		facts := cmd.Result.AsMap()
		if facts["cpus"] != float64(6) || facts["gpus"] != float64(1) || facts["memoryBytes"] != float64(16318480*1024) {
			t.Errorf("node.facts result %v", facts)
		}
		// R14.2: the node's answer is audited: by whom, what, on what.
		found := false
		for _, a := range h.audit(t, m.nodeID) {
			if a.Action == "command.done" && a.Actor == "node:"+m.nodeID && strings.Contains(string(a.Data), `"commandId":"`+id+`"`) &&
				strings.Contains(string(a.Data), `"kind":"node.facts"`) {
				found = true
			}
		}
		if !found {
			t.Errorf("no command.done audit row by node:%s for %s: %v", m.nodeID, id, h.audit(t, m.nodeID))
		}

		// Retire: the live session ends at once (this replica's EndNode;
		// the API clock does not move), and bcd stops for good.
		if _, err := h.e.Admin.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: h.e.RootTenant, NodeId: m.nodeID, Reason: "test"})); err != nil {
			t.Fatal(err)
		}
		err = p.exited(t)
		if !errors.Is(err, run.ErrRetired) {
			t.Fatalf("bcd run after retire: %v, want ErrRetired", err)
		}
		if e, ok := errs.As(err); !ok || !strings.HasPrefix(e.Message, "this node was retired; ") {
			t.Errorf("bcd run says %v", err)
		}
		h.waitNode(t, m.nodeID, "disconnected after retire", func(n store.Node) bool { return n.Connection == store.Disconnected })
		if !h.disconnectedBecause(t, m.nodeID, "retired") {
			t.Error("no node.disconnected event with reason retired")
		}
		_, err = h.dial(t, m, nil)
		if pe, ok := errs.As(wire.FromWire(err)); !ok || pe.Code != errs.AccessDenied || pe.Message != "Session refused" {
			t.Fatalf("session of a retired node without its key's proof: %v", err)
		}
		if !h.refusedWith(t, m.nodeID, "node-retired") {
			t.Error("no security.session.refused event with reason node-retired")
		}
		if n := h.node(t, m.nodeID); n.Connection != store.Disconnected || n.State != store.NodeRetired {
			t.Errorf("retired node is %s/%s", n.State, n.Connection)
		}
	})
}

// disconnectedBecause reports whether a node.disconnected event of the
// node names reason.
func (h *harness) disconnectedBecause(t testing.TB, nodeID, reason string) bool {
	t.Helper()
	// The session leaves the registry before its node.disconnected event
	// commits (and, on PostgreSQL, becomes visible): poll for it.
	return poll.Wait(15*time.Second, func() bool {
		for _, ev := range h.events(t, "node.disconnected") {
			var d map[string]any
			_ = json.Unmarshal(ev.Data, &d)
			if ev.Subject == nodeID && d["reason"] == reason {
				return true
			}
		}
		return false
	})
}
