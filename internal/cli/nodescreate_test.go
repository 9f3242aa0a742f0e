package cli_test

import (
	"regexp"
	"strings"
	"testing"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
)

var nodeIDLine = regexp.MustCompile(`^node_[0-9a-z]{26}\n$`)

// R3.6: nodes create prints the new node's id alone (for
// a script to capture), --json the node; --key replays; the node lists as
// pending; refusals print the code.
func TestNodesCreate(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		r := w.cli(t, "nodes", "create", "--tenant", w.root, "--pool", w.pool, "--hostname", "gpu-07", "--key", "deploy-7").ok(t)
		if !nodeIDLine.MatchString(r.stdout) {
			t.Fatalf("stdout %q, want the node id alone", r.stdout)
		}
		id := strings.TrimSpace(r.stdout)
		var n bcv1.Node
		w.cli(t, "nodes", "create", "--tenant", w.root, "--pool", w.pool, "--hostname", "gpu-07", "--key", "deploy-7", "--json").ok(t).decode(t, &n)
		if n.Id != id || n.State != "pending" || n.Hostname != "gpu-07" || n.IdentityGeneration != 0 {
			t.Fatalf("replay %v, want node %s pending", &n, id)
		}
		if r := w.cli(t, "nodes", "list", "--tenant", w.root, "--pool", w.pool).ok(t); !strings.Contains(r.stdout, id) || !strings.Contains(r.stdout, "pending") {
			t.Fatalf("nodes table:\n%s", r.stdout)
		}
		w.cli(t, "nodes", "create", "--tenant", w.root).fails(t, "INVALID_ARGUMENT", "pool")
		w.cli(t, "nodes", "create", "--tenant", w.root, "--pool", w.acmePool).fails(t, "NOT_FOUND")
		w.cli(t, "nodes", "create", "--tenant", w.root, "--pool", w.pool, "--hostname", "bad host").fails(t, "INVALID_ARGUMENT", "hostname")
		w.cli(t, "nodes", "create", "--tenant", w.root, "--pool", w.pool, "--hostname", "gpu-08", "--key", "deploy-7").fails(t, "CONFLICT")
		if h := w.cli(t, "nodes", "create", "--help").ok(t); !strings.Contains(h.stdout, "--node-id") || !strings.Contains(h.stdout, "pending") {
			t.Fatalf("help:\n%s", h.stdout)
		}
	})
}
