// Package poll is the tests' one way to wait for what must happen in real
// time: a real process, a network round trip, a database another
// goroutine writes. It checks a condition every Interval until it holds,
// and fails the test naming what it waited for once the timeout passed.
//
// Time the code under test measures is moved on its injected clock
// instead (internal/shared/clock), and nothing here ever shows that
// something did not happen: a condition that holds "after a while" is the
// only thing it proves.
package poll

import (
	"testing"
	"time"
)

// Interval is how often a condition is checked.
const Interval = 20 * time.Millisecond

// Until checks cond every Interval until it holds; after timeout it fails t
// with "timed out waiting for " and what.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	UntilDetail(t, timeout, func() string { return what }, cond)
}

// UntilDetail is Until whose failure message is what() at the time it
// gave up (the state last seen, say).
func UntilDetail(t testing.TB, timeout time.Duration, what func() string, cond func() bool) {
	t.Helper()
	if !Wait(timeout, cond) {
		t.Fatalf("timed out after %s waiting for %s", timeout, what())
	}
}

// Wait checks cond every Interval until it holds (true) or timeout passed
// (false), for callers that fail in their own way.
func Wait(timeout time.Duration, cond func() bool) bool { return WaitEvery(timeout, Interval, cond) }

// WaitEvery is Wait checking every every instead of Interval: for a
// condition that costs a process or a round trip (the e2e tests run the
// CLI), checked less often.
func WaitEvery(timeout, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(every)
	}
	return true
}
