// Package goroutines is the tests' check that a component's Run joins
// every goroutine it started: take a Snapshot before starting it, and call
// Joined once Run returned.
//
// A goroutine counts as the component's when it is new since the snapshot
// and runs this module's code, or was started by it. Joined fails at once
// for one blocked in this module's code (Run returned without waiting for
// it: one Run waited for is past its last wait), and then polls until
// every such goroutine has ended: one running or runnable may be finishing
// its deferred calls after telling its owner it is done, and one that runs
// only library code (a server's Serve, say) shows by never ending that Run
// forgot it. Goroutines of the standard library and of other modules (a
// database/sql opener, an HTTP client's connection) are not checked.
//
// Only tests import it.
package goroutines

import (
	"bytes"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
)

// module prefixes every function of this module in a stack.
const module = "github.com/better-compute/better-compute/"

// Snapshot is the set of goroutines that existed when it was taken.
type Snapshot map[string]bool

// Take records the goroutines running now.
func Take() Snapshot {
	s := Snapshot{}
	for _, g := range stacks() {
		s[g.id] = true
	}
	return s
}

// goroutine is one goroutine of a stack dump.
type goroutine struct {
	id    string
	stack string
	// waiting: blocked (on a channel, a lock, I/O...), not running or
	// runnable as a goroutine finishing its deferred calls may be.
	waiting bool
	// runs: a frame of this module is on its stack; created: this
	// module's code started it.
	runs, created bool
}

// stacks parses runtime.Stack of every goroutine but the caller's; a
// frame counts as the module's only under one of pkgs when any are named.
func stacks(pkgs ...string) []goroutine {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	var out []goroutine
	for i, block := range bytes.Split(buf, []byte("\n\n")) {
		if i == 0 {
			continue // the caller's own
		}
		g := parse(string(block), pkgs...)
		if g.id != "" {
			out = append(out, g)
		}
	}
	return out
}

// parse reads one goroutine's block: "goroutine N [state]:", then a
// function line and a file line per frame, then "created by F in
// goroutine M" and its file line.
func parse(block string, pkgs ...string) goroutine {
	lines := strings.Split(strings.TrimSpace(block), "\n")
	head, ok := strings.CutPrefix(lines[0], "goroutine ")
	if !ok {
		return goroutine{}
	}
	id, state, _ := strings.Cut(head, " ")
	state = strings.TrimPrefix(state, "[")
	if i := strings.IndexAny(state, ",]"); i >= 0 {
		state = state[:i]
	}
	g := goroutine{id: id, stack: block, waiting: state != "running" && state != "runnable"}
	// Frames come as a function line and its file line (tab-indented);
	// a long stack has a "...additional frames elided..." line too.
	for i := 1; i+1 < len(lines); i++ {
		fn, file := lines[i], lines[i+1]
		if strings.HasPrefix(fn, "\t") || !strings.HasPrefix(file, "\t") {
			continue
		}
		creator, created := strings.CutPrefix(fn, "created by ")
		if !ours(creator, file, pkgs) {
			continue
		}
		if created {
			g.created = true
		} else {
			g.runs = true
		}
	}
	return g
}

// ours reports whether a frame (its function and file lines) is this
// module's code. Tests' code is not: a test waits for its own goroutines,
// and a fake's handler blocked on purpose is the fake's.
func ours(fn, file string, pkgs []string) bool {
	file, _, _ = strings.Cut(strings.TrimSpace(file), " +")
	rel, ok := strings.CutPrefix(fn, module)
	if !ok || strings.HasPrefix(rel, "internal/checks/") || strings.Contains(file, "_test.go:") {
		return false
	}
	if len(pkgs) == 0 {
		return true
	}
	for _, p := range pkgs {
		if strings.HasPrefix(rel, p) {
			return true
		}
	}
	return false
}

// Joined fails t for each goroutine started since before that is blocked
// in this module's code now, and waits for those this module started or
// runs to end. Call it right after the component's Run returned. pkgs,
// when given, narrow "this module" to the packages under these paths
// ("internal/node/"): a test that runs other components beside the one
// it stops (an API, a gateway) checks only that one.
func Joined(t testing.TB, before Snapshot, pkgs ...string) {
	t.Helper()
	var running []string
	for _, g := range stacks(pkgs...) {
		if !before[g.id] && g.runs && g.waiting {
			running = append(running, g.stack)
		}
	}
	if len(running) > 0 {
		t.Fatalf("%d goroutine(s) blocked in this module's code after Run returned:\n\n%s", len(running), strings.Join(running, "\n\n"))
	}
	var left []string
	poll.UntilDetail(t, 10*time.Second, func() string {
		return fmt.Sprintf("%d goroutine(s) started by this module to end:\n\n%s", len(left), strings.Join(left, "\n\n"))
	}, func() bool {
		left = left[:0]
		for _, g := range stacks(pkgs...) {
			if !before[g.id] && (g.runs || g.created) {
				left = append(left, g.stack)
			}
		}
		return len(left) == 0
	})
}
