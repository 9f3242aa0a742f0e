package cli_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// hostile is what a compromised node answers: an OSC that retitles the
// terminal, a CSI that clears it (7-bit and C1 forms), a carriage return
// that overwrites the line, a bidi override and a forged table row.
const hostile = "ok\x1b]0;pwned\x07\x1b[2J\u009b2J\rFAKE\u202e\nnode_x  done"

// rawControl reports the first raw control character in s other than
// newline and tab.
func rawControl(s string) (rune, bool) {
	for _, c := range s {
		if c == '\n' || c == '\t' {
			continue
		}
		if c < 0x20 || c == 0x7f || c >= 0x80 && c < 0xa0 || c >= 0x202a && c <= 0x202e {
			return c, true
		}
	}
	return 0, false
}

// node-controlled text (a command's error and output,
// event data) never reaches the terminal raw, in tables, in plain text, in
// error lines and in JSON; JSON keeps the exact value.
func TestNodeTextEscaped(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		node := w.joinNode(t, 41)
		ctx := context.Background()

		var done bcv1.Command
		facts, _ := json.Marshal(map[string]string{"hostname": hostile})
		answer(t, e.DB, node, store.CommandDone, facts, "")
		w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "node.facts", "--wait", "--json").ok(t).decode(t, &done)
		if got := done.Result.AsMap()["hostname"]; got != hostile {
			t.Fatalf("JSON keeps the exact value: got %q, want %q", got, hostile)
		}
		answer(t, e.DB, node, store.CommandFailed, nil, hostile)
		failed := w.cli(t, "commands", "enqueue", node, "--tenant", w.root, "--kind", "vendor.thing", "--wait")
		if failed.code != 1 || !strings.Contains(failed.stderr, `ok\u001b]0;pwned\u0007`) {
			t.Fatalf("--wait error line: %q", failed.stderr)
		}

		mustOK := func(err error) {
			t.Helper()
			if err != nil {
				t.Fatal(err)
			}
		}
		mustOK(e.DB.WithTx(ctx, func(tx *store.Tx) error {
			return events.Publish(ctx, tx, nil, events.Event{TenantID: w.root, Type: "node.test", Subject: node,
				Data: map[string]any{"error": hostile}})
		}))
		mustOK(e.DB.WaitEventsVisible(ctx, w.root, 15*time.Second))

		for _, args := range [][]string{
			{"commands", "list", "--tenant", w.root},
			{"commands", "get", done.Id, "--tenant", w.root},
			{"commands", "get", done.Id, "--tenant", w.root, "--json"},
			{"commands", "list", "--tenant", w.root, "--json"},
			{"events", "list", "--tenant", w.root, "--type", "node.test"},
			{"events", "list", "--tenant", w.root, "--type", "node.test", "--json"},
		} {
			t.Run(strings.Join(args[:2], " ")+map[bool]string{true: " --json", false: ""}[args[len(args)-1] == "--json"], func(t *testing.T) {
				r := w.cli(t, args...).ok(t)
				for _, out := range []string{r.stdout, r.stderr} {
					if c, bad := rawControl(out); bad {
						t.Fatalf("raw %U in output:\n%q", c, out)
					}
				}
				if args[len(args)-1] != "--json" && !strings.Contains(r.stdout, `\u001b[2J`) {
					t.Fatalf("escaped text missing from:\n%s", r.stdout)
				}
				if strings.Contains(r.stdout, "\nnode_x") {
					t.Fatalf("a node forged a row:\n%s", r.stdout)
				}
			})
		}
	})
}
