package deptest

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite each binary's deps.txt from go list")

// updateCmd rewrites every binary's dependency list.
const updateCmd = "go test ./internal/checks/deptest -run TestBinaryDeps -update"

// binary is a program whose dependencies are checked in (after Tailscale's
// depaware): list is the file, relative to the repository, that names every
// package outside this module it links, so that a change of what it links
// shows in review; forbidden are packages it must never link.
type binary struct {
	pkg, list string
	forbidden []string
	why       string
}

var binaries = []binary{
	{
		pkg:  "./cmd/bcd",
		list: "cmd/bcd/deps.txt",
		// html/template and text/template's execution also turn off the
		// linker's removal of unused methods (they call methods by name).
		forbidden: []string{
			"google.golang.org/grpc", "github.com/grpc-ecosystem/grpc-gateway/", "google.golang.org/genproto/",
			"=html/template", "github.com/prometheus/",
			"=" + module + "gen/bettercompute/v1", module + "gen/bettercompute/v1/bcv1connect",
		},
		why: "bcd runs on every machine: it links neither gRPC nor grpc-gateway (OTLP goes over plain HTTP), nor the operator API (its errors' detail is gen/bettercompute/v1/errordetail), nor html/template, nor the Prometheus client (node/diag writes its three metrics)",
	},
}

// binaryEnv is the build bcd ships with (static, linux/amd64): the list
// must not depend on the machine that runs the test.
var binaryEnv = []string{"GOOS=linux", "GOARCH=amd64", "CGO_ENABLED=0"}

// TestBinaryDeps fails when a binary links a forbidden package, or links
// other packages than its checked-in list says.
func TestBinaryDeps(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	for _, b := range binaries {
		t.Run(b.pkg, func(t *testing.T) {
			all, imports := linked(t, b.pkg)
			for _, d := range all {
				if f := forbiddenBy(b.forbidden, d); f != "" {
					t.Errorf("%s links %s (rule: %s), through %s", b.pkg, d, b.why, chain(all, imports, d))
				}
			}
			path := filepath.Join("../../..", b.list)
			want := depsFile(b, outside(all))
			if *update {
				if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			got, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v: run %s", err, updateCmd)
			}
			if added, removed := diffLines(string(got), want); len(added)+len(removed) > 0 {
				t.Errorf("%s links other packages than %s says: run %s and review the change\n  now linked: %v\n  no longer linked: %v",
					b.pkg, b.list, updateCmd, added, removed)
			}
		})
	}
}

// linked lists every package pkg links, in the shipped build, each with
// the packages it imports.
func linked(t *testing.T, pkg string) (deps []string, imports map[string][]string) {
	t.Helper()
	cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}} {{join .Imports \" \"}}", pkg)
	cmd.Dir = "../../.."
	cmd.Env = append(os.Environ(), binaryEnv...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	imports = map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		deps = append(deps, f[0])
		imports[f[0]] = f[1:]
	}
	return deps, imports
}

// chain is the shortest import path from the last of deps (the root:
// go list -deps prints it last) to dep.
func chain(deps []string, imports map[string][]string, dep string) string {
	root := deps[len(deps)-1]
	prev := map[string]string{root: ""}
	queue := []string{root}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		for _, q := range imports[p] {
			if _, seen := prev[q]; !seen {
				prev[q] = p
				queue = append(queue, q)
			}
		}
	}
	var path []string
	for p := dep; p != ""; p = prev[p] {
		path = append(path, strings.TrimPrefix(p, module))
	}
	slices.Reverse(path)
	return strings.Join(path, " -> ")
}

// outside is the packages of deps outside this module, sorted, the
// standard library's internal packages left out (they change with every
// Go release and are no one's choice).
func outside(deps []string) []string {
	var out []string
	for _, p := range deps {
		if strings.HasPrefix(p, module) || p+"/" == module || stdInternal(p) {
			continue
		}
		out = append(out, p)
	}
	slices.Sort(out)
	return out
}

// stdInternal reports whether p is a standard-library package no program
// imports itself (internal/..., vendor/..., .../internal/...). A standard
// package's path has no dot in its first element.
func stdInternal(p string) bool {
	first, _, _ := strings.Cut(p, "/")
	if strings.Contains(first, ".") {
		return false
	}
	return first == "internal" || first == "vendor" || strings.Contains(p, "/internal/") || strings.HasSuffix(p, "/internal")
}

// depsFile is the checked-in list of b's dependencies.
func depsFile(b binary, deps []string) string {
	var s strings.Builder
	fmt.Fprintf(&s, "# The packages outside this module that %s links (%s),\n", b.pkg, strings.Join(binaryEnv, " "))
	s.WriteString("# the standard library's internal packages left out. TestBinaryDeps\n")
	fmt.Fprintf(&s, "# (internal/checks/deptest) fails when this differs; update with:\n#   %s\n", updateCmd)
	for _, d := range deps {
		s.WriteString(d + "\n")
	}
	return s.String()
}

// diffLines lists the lines of want missing from got (added) and those of
// got missing from want (removed), comments aside.
func diffLines(got, want string) (added, removed []string) {
	lines := func(s string) map[string]bool {
		m := map[string]bool{}
		for _, l := range strings.Split(s, "\n") {
			if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
				m[l] = true
			}
		}
		return m
	}
	g, w := lines(got), lines(want)
	for l := range w {
		if !g[l] {
			added = append(added, l)
		}
	}
	for l := range g {
		if !w[l] {
			removed = append(removed, l)
		}
	}
	slices.Sort(added)
	slices.Sort(removed)
	return added, removed
}

func TestStdInternal(t *testing.T) {
	for p, want := range map[string]bool{
		"internal/cpu": true, "vendor/golang.org/x/net/idna": true, "crypto/internal/fips140/aes": true,
		"net/http/internal": true, "html/template": false, "net/http": false,
		"google.golang.org/protobuf/internal/impl": false, "connectrpc.com/connect": false,
	} {
		if got := stdInternal(p); got != want {
			t.Errorf("stdInternal(%s) = %v, want %v", p, got, want)
		}
	}
}
