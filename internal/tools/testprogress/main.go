// Command testprogress reads `go test -json` on standard input and prints
// what `go test` would (each package's ok/FAIL line, and the output of
// every test that failed), plus, at least once a minute while tests run, a
// line saying which are still running: the suite's long end-to-end tests
// are otherwise silent for minutes. What a test skipped for a missing tool
// (its "SKIPPING" lines, internal/checks/tools and browser) is printed when
// it happens and again in a banner at the end, so a green run cannot hide
// a browser test that never ran. It exits 1 when any test or package
// failed, or the input holds no result at all.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

// event is one line of `go test -json` (test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

type state struct {
	mu      sync.Mutex
	out     io.Writer
	running map[string]time.Time        // "pkg Test" -> started
	logs    map[string]*strings.Builder // output of a test until it ends
	failed  bool
	results int
	skipped []string // "pkg.Test: SKIPPING: why", in order
	start   time.Time
}

func (s *state) handle(e event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := e.Package + " " + e.Test
	switch {
	case e.Action == "build-output":
		fmt.Fprint(s.out, e.Output)
	case e.Action == "build-fail":
		s.failed = true
	case e.Test == "" && e.Action == "output":
		// The package's own lines: ok, FAIL, "?   … [no test files]";
		// not the bare PASS a non-verbose go test does not show either.
		if e.Output != "PASS\n" {
			fmt.Fprint(s.out, e.Output)
		}
	case e.Test == "" && (e.Action == "pass" || e.Action == "fail" || e.Action == "skip"):
		s.results++
		if e.Action == "fail" {
			s.failed = true
			s.flushRunning(e.Package)
		}
	case e.Action == "run":
		s.running[key] = time.Now()
		s.logs[key] = &strings.Builder{}
	case e.Action == "output":
		if b := s.logs[key]; b != nil {
			b.WriteString(e.Output)
		}
		if _, why, ok := strings.Cut(e.Output, "SKIPPING"); ok {
			line := fmt.Sprintf("%s.%s: SKIPPING%s", e.Package[strings.LastIndex(e.Package, "/")+1:], e.Test, strings.TrimRight(why, "\n"))
			s.skipped = append(s.skipped, line)
			fmt.Fprintln(s.out, "SKIP "+line)
		}
	case e.Action == "pass" || e.Action == "skip" || e.Action == "fail":
		if e.Action == "fail" {
			s.failed = true
			if b := s.logs[key]; b != nil {
				fmt.Fprint(s.out, b.String())
			}
		}
		delete(s.running, key)
		delete(s.logs, key)
	}
}

// flushRunning prints the output of pkg's tests that were still running
// when the package failed: a timeout's panic and goroutine dump are
// attributed to the test running then, which never gets a fail of its own.
func (s *state) flushRunning(pkg string) {
	var keys []string
	for k := range s.running {
		if p, _, _ := strings.Cut(k, " "); p == pkg {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		_, test, _ := strings.Cut(k, " ")
		fmt.Fprintf(s.out, "--- %s was still running when %s failed:\n", test, pkg)
		if b := s.logs[k]; b != nil {
			fmt.Fprint(s.out, b.String())
		}
		delete(s.running, k)
		delete(s.logs, k)
	}
}

// progress prints which tests are running, longest first.
func (s *state) progress() {
	s.mu.Lock()
	defer s.mu.Unlock()
	type r struct {
		name  string
		since time.Time
	}
	var rs []r
	for k, t := range s.running {
		pkg, test, _ := strings.Cut(k, " ")
		if strings.Contains(test, "/") {
			continue // subtests: their parent is listed
		}
		rs = append(rs, r{pkg[strings.LastIndex(pkg, "/")+1:] + "." + test, t})
	}
	slices.SortFunc(rs, func(a, b r) int { return a.since.Compare(b.since) })
	names := make([]string, 0, len(rs))
	for _, x := range rs[:min(len(rs), 6)] {
		names = append(names, fmt.Sprintf("%s (%s)", x.name, time.Since(x.since).Round(time.Second)))
	}
	more := ""
	if len(rs) > 6 {
		more = fmt.Sprintf(" and %d more", len(rs)-6)
	}
	fmt.Fprintf(s.out, "… %s into the suite, %d packages done; running: %s%s\n",
		time.Since(s.start).Round(time.Second), s.results, strings.Join(names, ", "), more)
}

// summary prints, last, what was skipped for a missing tool.
func (s *state) summary() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.skipped) == 0 {
		return
	}
	bar := strings.Repeat("#", 80)
	fmt.Fprintf(s.out, "\n%s\n##   %d skipped for a missing tool (a test or a part of one did NOT run):\n", bar, len(s.skipped))
	for _, l := range s.skipped {
		fmt.Fprintln(s.out, "##   "+l)
	}
	fmt.Fprintf(s.out, "%s\n\n", bar)
}

func main() {
	s := &state{out: os.Stdout, running: map[string]time.Time{}, logs: map[string]*strings.Builder{}, start: time.Now()}
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(time.Minute)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				s.progress()
			}
		}
	}()
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var e event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			// Not test2json (a build failure before any test): pass it on.
			fmt.Fprintln(s.out, sc.Text())
			s.failed = true
			continue
		}
		s.handle(e)
	}
	close(done)
	s.summary()
	if s.failed || s.results == 0 {
		os.Exit(1)
	}
}
