package tools

import (
	"testing"
)

// fakeT records what a helper did to the test instead of doing it.
type fakeT struct {
	testing.TB
	failed, skipped bool
	logs            int
}

func (f *fakeT) Helper()                {}
func (f *fakeT) Fatalf(string, ...any)  { f.failed = true; panic(f) }
func (f *fakeT) Skipf(string, ...any)   { f.skipped = true; panic(f) }
func (f *fakeT) Logf(string, ...any)    { f.logs++ }
func run(f *fakeT, fn func(testing.TB)) { defer func() { _ = recover() }(); fn(f) }

const missing = "bc-no-such-tool-anywhere"

func TestNeed(t *testing.T) {
	for _, c := range []struct {
		ci         string
		fail, skip bool
	}{{"true", true, false}, {"", false, true}, {"false", false, true}} {
		t.Setenv("CI", c.ci)
		f := &fakeT{TB: t}
		run(f, func(tb testing.TB) { Need(tb, missing, "a test") })
		if f.failed != c.fail || f.skipped != c.skip {
			t.Errorf("CI=%q: failed %v skipped %v, want %v %v", c.ci, f.failed, f.skipped, c.fail, c.skip)
		}
	}
	t.Setenv("CI", "true")
	if p := Need(t, "go", "a test"); p == "" {
		t.Error("Need found no path for go")
	}
}

func TestWant(t *testing.T) {
	t.Setenv("CI", "")
	f := &fakeT{TB: t}
	var ok bool
	run(f, func(tb testing.TB) { _, ok = Want(tb, missing, "a test") })
	if ok || f.failed || f.skipped || f.logs != 1 {
		t.Errorf("outside CI: ok %v failed %v skipped %v logs %d, want only a log", ok, f.failed, f.skipped, f.logs)
	}
	t.Setenv("CI", "true")
	f = &fakeT{TB: t}
	run(f, func(tb testing.TB) { Want(tb, missing, "a test") })
	if !f.failed {
		t.Error("in CI a missing tool did not fail the test")
	}
}
