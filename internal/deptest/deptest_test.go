// Package deptest holds the project's dependency rules as tests (after
// Tailscale's deptest): the gateway and bcd carry no database code and
// none of the control plane's keys or identity core, so a compromised or
// misconfigured gateway or node can neither read nor mint anything through
// code it ships with.
package deptest

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/better-compute/better-compute/"

// forbidden lists, per importer, the packages it must never depend on,
// directly or not.
var rules = []struct {
	pkgs      []string
	forbidden []string
}{
	{
		pkgs: []string{"./internal/gateway/...", "./internal/bcd/...", "./cmd/bcd"},
		forbidden: []string{
			"database/sql",
			"modernc.org/sqlite",
			"github.com/jackc/pgx/v5",
			module + "internal/store",
			module + "internal/nodeident",
			module + "internal/join",
			module + "internal/session",
			module + "internal/api",
		},
	},
}

// DESIGN rule 10: the gateway and bcd never import the store, a
// SQL driver or the API's identity core.
func TestDependencyRules(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	for _, r := range rules {
		args := append([]string{"list", "-deps", "-f", "{{.ImportPath}} {{join .Deps \" \"}}"}, r.pkgs...)
		cmd := exec.Command("go", args...)
		cmd.Dir = "../.."
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("go list: %v\n%s", err, out)
		}
		deps := map[string]bool{}
		for _, line := range strings.Split(string(out), "\n") {
			for _, f := range strings.Fields(line) {
				deps[f] = true
			}
		}
		if !deps[module+"internal/gateway"] || !deps[module+"internal/bcd/run"] {
			t.Fatalf("go list did not list the packages under test:\n%s", out)
		}
		for _, f := range r.forbidden {
			if deps[f] {
				t.Errorf("%v depends on %s", r.pkgs, f)
			}
		}
	}
}
