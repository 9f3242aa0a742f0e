// Package deptest holds the project's dependency rules as tests (after
// Tailscale's deptest). The folders under internal/ say which process a
// package runs in:
//
//   - controlplane/: the API server (better-compute serve): the store, the
//     identity core, JoinService, sessions, the operator API;
//   - node/: the daemon bcd on every machine;
//   - gateway/: the regional gateway, which relays and is not trusted;
//   - shared/: what more than one process needs (wire, pins, seals, the
//     clock, errors, hardware claims, bcd's config format);
//   - client/: the operator API's Go client, used by the CLI, the web
//     console and tests;
//   - cli/, tools/, checks/: the better-compute command, the load
//     generator, and tests like this one.
//
// The rules below keep those folders honest: a compromised or
// misconfigured gateway or node can neither read nor mint anything through
// code it ships with, and shared code depends on no process.
//
// binaries_test.go holds what a binary links: each checked-in deps.txt
// (cmd/bcd/deps.txt) lists the packages outside this module the binary
// links, so a new dependency shows in review, and packages a binary must
// never link (bcd: gRPC, grpc-gateway, html/template, the operator API,
// the Prometheus client)
// fail with the import chain that brought them in.
package deptest

import (
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/better-compute/better-compute/"

// rule forbids every package matching pkgs to depend, directly or not, on
// any package under the forbidden prefixes. The packages' tests are held
// to the same rule (go list -test), except for what testsMay lists, for
// the reason testsWhy gives: a test may run the process on the other side
// in-process, but what it imports must not leak into the package.
type rule struct {
	why       string
	pkgs      string
	forbidden []string
	testsMay  []string
	testsWhy  string
	// pending lists forbidden dependencies the code still has, each
	// exactly (package, dependency) with what removes it: a new one
	// fails, and an entry no longer needed fails too, so the list only
	// shrinks.
	pending []pending
}

// pending is one known forbidden dependency of a non-test package.
type pending struct{ pkg, dep, why string }

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
		testsMay:  endToEnd,
		testsWhy:  endToEndWhy,
	},
	{
		why:       "bcd runs on every machine: it carries no control-plane code and no database code",
		pkgs:      "./internal/node/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/gateway", module + "internal/client"}, sqlDrivers...),
		testsMay:  endToEnd,
		testsWhy:  endToEndWhy,
	},
	{
		why:       "bcd's binary links only the node and shared code",
		pkgs:      "./cmd/bcd",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/gateway", module + "internal/cli", module + "internal/client"}, sqlDrivers...),
	},
	{
		why:       "the operator client is a client of the API like any other: it links no process's code",
		pkgs:      "./internal/client/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/node/", module + "internal/gateway", module + "internal/cli"}, sqlDrivers...),
	},
	{
		why:       "the better-compute command runs the API and the gateway and is the operator's client; it links none of bcd (what it writes for a development bcd, the config format and a fake machine, is shared)",
		pkgs:      "./internal/cli/...",
		forbidden: []string{module + "internal/node/"},
		testsMay:  []string{module + "internal/node/"},
		testsWhy:  "dev's tests run the real bcd against the development control plane",
	},
	{
		why:       "shared code is imported by every process, so it depends on none of them",
		pkgs:      "./internal/shared/...",
		forbidden: append([]string{module + "internal/controlplane/", module + "internal/node/", module + "internal/gateway", module + "internal/cli"}, sqlDrivers...),
		testsMay:  []string{module + "internal/node/tpmdevice", module + "internal/node/identity"},
		testsWhy:  "TPM verification is tested against quotes a real software TPM makes through bcd's TPM code (tpmdevice/tpmtest)",
	},
	{
		why:       "the API process talks to bcd only over the wire, and the CLI is a client of the API, never a part of it",
		pkgs:      "./internal/controlplane/...",
		forbidden: []string{module + "internal/cli", module + "internal/node/"},
		testsMay:  []string{module + "internal/node/"},
		testsWhy:  "join tests run bcd's join (and its TPM code on a software TPM) against a real API in-process",
	},
}

// endToEnd is what node and gateway tests may depend on: they run a real
// API (apitest, the store on SQLite or PostgreSQL, JoinService) and a
// gateway in-process, so one test covers bcd, gateway and API together.
var endToEnd = append([]string{module + "internal/controlplane/", module + "internal/gateway", module + "internal/node/", module + "internal/client"}, sqlDrivers...)

const endToEndWhy = "end-to-end tests run a real API and gateway in-process against the code under test"

// The dependency rules, checked per package and per test variant: each
// failure names the package (a test variant is "pkg [pkg.test]") and the
// dependency it must not have.
func TestDependencyRules(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	for _, r := range rules {
		t.Run(r.pkgs, func(t *testing.T) {
			// Fields are separated by tabs: a test variant's path holds a space.
			cmd := exec.Command("go", "list", "-test", "-deps=false", "-f", "{{.ImportPath}}\t{{join .Deps \"\t\"}}", r.pkgs)
			cmd.Dir = "../../.."
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("go list: %v\n%s", err, out)
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			if len(lines) == 0 || lines[0] == "" {
				t.Fatalf("go list found no package for %s", r.pkgs)
			}
			used := map[pending]bool{}
			for _, line := range lines {
				f := strings.Split(line, "\t")
				for _, v := range r.violations(f[0], f[1:], used) {
					t.Error(v)
				}
			}
			for _, p := range r.pending {
				if !used[p] {
					t.Errorf("%s no longer depends on %s: delete its pending entry", p.pkg, p.dep)
				}
			}
		})
	}
}

// violations lists pkg's forbidden dependencies among deps, marking in used
// the pending entries that excuse one.
func (r rule) violations(pkg string, deps []string, used map[pending]bool) []string {
	// A test variant is "pkg [pkg.test]", its external test package
	// "pkg_test [pkg.test]", and the test binary's main "pkg.test".
	test := strings.Contains(pkg, " [") || strings.HasSuffix(pkg, ".test")
	var out []string
	for _, d := range deps {
		d, _, _ = strings.Cut(d, " ") // a dependency recompiled for a test: "dep [pkg.test]"
		if d == "" || forbiddenBy(r.forbidden, d) == "" {
			continue
		}
		if test {
			if forbiddenBy(r.testsMay, d) == "" {
				out = append(out, fmt.Sprintf("%s depends on %s (rule: %s; tests may depend on %v only: %s)", pkg, d, r.why, r.testsMay, r.testsWhy))
			}
			continue
		}
		p := pending{pkg: strings.TrimPrefix(pkg, module), dep: strings.TrimPrefix(d, module)}
		if i := slices.IndexFunc(r.pending, func(q pending) bool { return q.pkg == p.pkg && q.dep == p.dep }); i >= 0 {
			used[r.pending[i]] = true
			continue
		}
		out = append(out, fmt.Sprintf("%s depends on %s (rule: %s)", pkg, d, r.why))
	}
	return out
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
