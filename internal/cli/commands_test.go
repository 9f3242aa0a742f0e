package cli_test

import (
	"context"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// joinNode joins machine i into the root tenant's pool through the real
// JoinService and returns its node id.
func (w *world) joinNode(t *testing.T, i int) string {
	t.Helper()
	tok := w.mkTokens(t, w.pool, 1, 3600)[0]
	m := jointest.NewMachine(t, jointest.Claims(i))
	res, err := w.e.Server.Join().Join(context.Background(), m.Request(t, w.e.Bundle, tok.Token, ""), join.Peer{Addr: "192.0.2.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	return m.Verify(t, w.e.Bundle, res, "").Body.NodeId
}

// answer plays the node: it finishes the node's next queued command with
// state and result, as a session would on the node's answer.
func answer(t *testing.T, db *store.DB, nodeID, state string, result []byte, errText string) {
	t.Helper()
	go func() {
		ctx := context.Background()
		// In its own goroutine the test's t must not fail: a node that never
		// gets the command makes the caller's wait fail instead.
		poll.Wait(10*time.Second, func() bool {
			var done bool
			_ = db.WithTx(ctx, func(tx *store.Tx) error {
				q, err := tx.QueuedCommands(ctx, nodeID, 1)
				if err != nil || len(q) == 0 {
					return err
				}
				if _, err := tx.MarkCommandSent(ctx, q[0].ID); err != nil {
					return err
				}
				done, err = tx.FinishCommand(ctx, q[0].ID, state, result, errText)
				return err
			})
			return done
		})
	}()
}

// R12.3, R7.5, R13.2: commands enqueue/list/get and nodes retire, with
// tables, --json and the error form.
func TestCommandsSmoke(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		node := w.joinNode(t, 1)

		var c bcv1.Command
		w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts", "--ttl", "90s", "--json").ok(t).decode(t, &c)
		if c.State != "queued" || c.Kind != "node.facts" || c.ExpiresAt.AsTime().Sub(c.CreatedAt.AsTime()) != 90*time.Second {
			t.Fatalf("enqueued %v", &c)
		}
		r := w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "acceptance.check", "--args", `{"minCpus":2}`).ok(t)
		if !strings.HasPrefix(r.stdout, "FIELD ") || !strings.Contains(r.stdout, `{"minCpus":2}`) || !strings.Contains(r.stdout, "queued") {
			t.Fatalf("enqueue table:\n%s", r.stdout)
		}

		// --wait follows the command to its answer.
		answer(t, e.DB, node, store.CommandDone, []byte(`{"cpus":2,"hostname":"host-1"}`), "")
		var waited bcv1.Command
		// The two queued commands above come first: finish them too.
		answer(t, e.DB, node, store.CommandDone, []byte(`{"cpus":2}`), "")
		answer(t, e.DB, node, store.CommandDone, []byte(`{"cpus":2}`), "")
		r = w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts", "--wait", "--json").ok(t)
		r.decode(t, &waited)
		if waited.State != "done" || waited.Result.AsMap()["cpus"] != float64(2) {
			t.Fatalf("waited %v", &waited)
		}
		if !strings.Contains(r.stderr, waited.Id) || !strings.Contains(r.stderr, ": done") {
			t.Errorf("progress on stderr: %q", r.stderr)
		}
		answer(t, e.DB, node, store.CommandFailed, nil, "unknown kind")
		r = w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "vendor.thing", "--wait")
		lines := strings.SplitAfter(r.stderr, "\n")
		if len(lines) < 2 {
			t.Fatalf("stderr %q", r.stderr)
		}
		// Progress lines, then the error line.
		result{code: r.code, stderr: lines[len(lines)-2]}.fails(t, "INVALID_STATE", "failed", "unknown kind")
		if r.stdout != "" {
			t.Errorf("stdout of a failed --wait: %q", r.stdout)
		}

		var l bcv1.ListCommandsResponse
		w.cli(t, "commands", "list", "--tenant", w.root, "--node", node, "--json").ok(t).decode(t, &l)
		if len(l.Items) != 4 || l.Items[0].Kind != "vendor.thing" {
			t.Fatalf("list: %d items", len(l.Items))
		}
		if r := w.cli(t, "commands", "list", "--tenant", w.root).ok(t); !strings.HasPrefix(r.stdout, "ID ") || strings.Count(r.stdout, "\n") != 5 {
			t.Fatalf("list table:\n%s", r.stdout)
		}
		if r := w.cli(t, "commands", "get", waited.Id, "--tenant", w.root).ok(t); !strings.Contains(r.stdout, "result:") || !strings.Contains(r.stdout, `"cpus": 2`) {
			t.Fatalf("get:\n%s", r.stdout)
		}

		tests := []struct {
			name string
			args []string
			code string
			want []string
		}{
			{"bad kind", []string{"commands", "enqueue", node, "--tenant", w.root, "--kind", "facts"}, "INVALID_ARGUMENT", []string{"not a command kind"}},
			{"args not an object", []string{"commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts", "--args", "[1]"}, "INVALID_ARGUMENT", []string{"JSON object"}},
			{"ttl too long", []string{"commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts", "--ttl", "25h"}, "INVALID_ARGUMENT", []string{"24h"}},
			{"missing tenant", []string{"commands", "list"}, "INVALID_ARGUMENT", []string{"--tenant"}},
			{"unknown command", []string{"commands", "get", "cmd_nosuch", "--tenant", w.root}, "NOT_FOUND", nil},
			{"another tenant's node", []string{"commands", "enqueue", node, "--tenant", w.acme, "--kind", "node.facts"}, "NOT_FOUND", nil},
			{"retire another tenant's node", []string{"nodes", "retire", node, "--tenant", w.acme}, "NOT_FOUND", nil},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				env := w.env
				if strings.Contains(strings.Join(tc.args, " "), w.acme) {
					env = w.as(w.acmeKey)
				}
				run(t, env, tc.args...).fails(t, tc.code, tc.want...)
			})
		}

		var n bcv1.Node
		w.cli(t, "nodes", "retire", node, "--tenant", w.root, "--reason", "decommissioned", "--json").ok(t).decode(t, &n)
		if n.State != "retired" || n.StateReason != "decommissioned" {
			t.Fatalf("retired node %s %q", n.State, n.StateReason)
		}
		if r := w.cli(t, "nodes", "retire", node, "--tenant", w.root).ok(t); !strings.Contains(r.stdout, "retired (decommissioned)") {
			t.Fatalf("retire again:\n%s", r.stdout)
		}
		w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts").fails(t, "INVALID_STATE", "retired")
	})
}
