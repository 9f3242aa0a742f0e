// Package deptest holds the project's dependency rules as tests (after
// Tailscale's deptest). The folders under internal/ say which process a
// package runs in:
//
//   - controlplane/: the API server (better-compute serve): the store, the
//     identity core, JoinService, sessions, the operator API;
//   - node/: the daemon bcd on every machine;
//   - gateway/: the regional gateway, which relays and is not trusted;
//   - shared/: what more than one process needs (wire, pins, seals, the
//     clock, errors, hardware claims);
//   - cli/, tools/, checks/: the better-compute command, the load
//     generator, and tests like this one.
//
// The rules below keep those folders honest: a compromised or
// misconfigured gateway or node can neither read nor mint anything through
// code it ships with, and shared code depends on no process.
package deptest

import (
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/better-compute/better-compute/"

// rule forbids every package matching pkgs to depend, directly or not, on
// any package under the forbidden prefixes.
type rule struct {
	why       string
	pkgs      string
	forbidden []string
}

// sqlDrivers is database code: database/sql itself (exactly: "=") and the
// drivers. database/sql/driver, only the driver interfaces, is allowed:
// github.com/google/uuid implements its Valuer, and OpenTelemetry's SDK
// (internal/shared/tracing) uses uuid for instance ids; it links no
// database code.
var sqlDrivers = []string{"=database/sql", "modernc.org/sqlite", "github.com/jackc/pgx/"}

var rules = []rule{
	{
		why:       "the gateway relays and is not trusted: it carries no database code, keys or identity core",
		pkgs:      "./internal/gateway/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/node/"}, sqlDrivers...),
	},
	{
		why:       "bcd runs on every machine: it carries no control-plane code and no database code",
		pkgs:      "./internal/node/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/gateway"}, sqlDrivers...),
	},
	{
		why:       "bcd's binary links only the node and shared code",
		pkgs:      "./cmd/bcd",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/gateway", module + "internal/cli"}, sqlDrivers...),
	},
	{
		why:       "shared code is imported by every process, so it depends on none of them",
		pkgs:      "./internal/shared/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/node/", module + "internal/gateway", module + "internal/cli"}, sqlDrivers...),
	},
}

// DESIGN rule 10, checked per package: each failure names the package and
// the dependency it must not have.
func TestDependencyRules(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	for _, r := range rules {
		t.Run(r.pkgs, func(t *testing.T) {
			cmd := exec.Command("go", "list", "-deps=false", "-f", "{{.ImportPath}} {{join .Deps \" \"}}", r.pkgs)
			cmd.Dir = "../../.."
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("go list: %v\n%s", err, out)
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			if len(lines) == 0 || lines[0] == "" {
				t.Fatalf("go list found no package for %s", r.pkgs)
			}
			for _, line := range lines {
				f := strings.Fields(line)
				pkg, deps := f[0], f[1:]
				for _, d := range deps {
					if bad := forbiddenBy(r.forbidden, d); bad != "" {
						t.Errorf("%s depends on %s (rule: %s)", pkg, d, r.why)
					}
				}
			}
		})
	}
}

// forbiddenBy returns the prefix of forbidden that dep falls under, "" for
// none. A prefix ending in "/" covers the packages below it; any other
// covers itself and the packages below it; one starting "=" covers
// exactly the package it names.
func forbiddenBy(forbidden []string, dep string) string {
	for _, f := range forbidden {
		if exact, ok := strings.CutPrefix(f, "="); ok {
			if dep == exact {
				return f
			}
			continue
		}
		if dep == strings.TrimSuffix(f, "/") || strings.HasPrefix(dep, strings.TrimSuffix(f, "/")+"/") {
			return f
		}
	}
	return ""
}

func TestForbiddenBy(t *testing.T) {
	for _, tc := range []struct {
		dep, want string
	}{
		{module + "internal/controlplane/store", module + "internal/controlplane/"},
		{module + "internal/gateway", module + "internal/gateway"},
		{module + "internal/gatewayx", ""},
		{"database/sql", "=database/sql"},
		{"database/sql/driver", ""},
		{"github.com/jackc/pgx/v5", "github.com/jackc/pgx/"},
		{module + "internal/shared/pki", ""},
	} {
		if got := forbiddenBy(append([]string{module + "internal/controlplane/", module + "internal/gateway"}, sqlDrivers...), tc.dep); got != tc.want {
			t.Errorf("forbiddenBy(%s) = %q, want %q", tc.dep, got, tc.want)
		}
	}
}
