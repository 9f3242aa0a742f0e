package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A test skipped for a missing tool (the console's browser test without
// chromium) and a part of a passing test skipped the same way are printed
// when they happen and listed again last; an ordinary skip is not.
func TestSkippedToolsAreShown(t *testing.T) {
	const pkg = "github.com/better-compute/better-compute/internal/controlplane/console"
	events := []event{
		{Action: "run", Package: pkg, Test: "TestBrowser"},
		{Action: "output", Package: pkg, Test: "TestBrowser", Output: "    browser.go:31: SKIPPING: chromium is not installed (a browser test of the web console)\n"},
		{Action: "output", Package: pkg, Test: "TestBrowser", Output: "--- SKIP: TestBrowser (0.00s)\n"},
		{Action: "skip", Package: pkg, Test: "TestBrowser"},
		{Action: "run", Package: pkg, Test: "TestLong"},
		{Action: "output", Package: pkg, Test: "TestLong", Output: "    x_test.go:9: about a minute\n"},
		{Action: "skip", Package: pkg, Test: "TestLong"},
		{Action: "run", Package: pkg, Test: "TestPart"},
		{Action: "output", Package: pkg, Test: "TestPart", Output: "    tools.go:40: SKIPPING what needs openssl: it is not installed (the CA)\n"},
		{Action: "pass", Package: pkg, Test: "TestPart"},
		{Action: "output", Package: pkg, Output: "ok  \t" + pkg + "\t1.0s\n"},
		{Action: "pass", Package: pkg},
	}
	var out strings.Builder
	s := &state{out: &out, running: map[string]time.Time{}, logs: map[string]*strings.Builder{}, start: time.Now()}
	for _, e := range events {
		b, _ := json.Marshal(e) // as go test -json writes it
		var back event
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		s.handle(back)
	}
	s.summary()
	got := out.String()
	for _, want := range []string{
		"SKIP console.TestBrowser: SKIPPING: chromium is not installed (a browser test of the web console)\n",
		"SKIP console.TestPart: SKIPPING what needs openssl: it is not installed (the CA)\n",
		"##   2 skipped for a missing tool",
		"##   console.TestBrowser: SKIPPING: chromium is not installed",
		"##   console.TestPart: SKIPPING what needs openssl",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the output lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "about a minute") {
		t.Errorf("an ordinary skip is listed:\n%s", got)
	}
	if s.failed {
		t.Error("a skip failed the run")
	}
}

// A package that times out fails with no fail event for the test running
// then: that test's output (the timeout's panic) is printed all the same,
// and another package's running test is left alone.
func TestTimedOutPackageShowsRunningTest(t *testing.T) {
	const pkg, other = "example.com/e2e", "example.com/store"
	var out strings.Builder
	s := &state{out: &out, running: map[string]time.Time{}, logs: map[string]*strings.Builder{}, start: time.Now()}
	for _, e := range []event{
		{Action: "run", Package: pkg, Test: "TestSlow"},
		{Action: "run", Package: other, Test: "TestOther"},
		{Action: "output", Package: pkg, Test: "TestSlow", Output: "panic: test timed out after 20m0s\n"},
		{Action: "output", Package: pkg, Output: "FAIL\t" + pkg + "\t1200.4s\n"},
		{Action: "fail", Package: pkg},
	} {
		s.handle(e)
	}
	got := out.String()
	if !strings.Contains(got, "TestSlow was still running when "+pkg+" failed") || !strings.Contains(got, "panic: test timed out") {
		t.Errorf("the timed-out test's output is missing:\n%s", got)
	}
	if _, ok := s.running[other+" TestOther"]; !ok || !s.failed {
		t.Errorf("running %v, failed %v", s.running, s.failed)
	}
}
