package console_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/console"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// fakeConsole is a console whose API admits every key (it answers every
// call 404, which is not UNAUTHENTICATED), so sign-ins cost no database.
type fakeConsole struct {
	t     *testing.T
	c     *console.Console
	clock *clock.Fake
	pre   *http.Cookie
	csrf  string
}

func newFakeConsole(t *testing.T, cfg console.Config) *fakeConsole {
	t.Helper()
	f := &fakeConsole{t: t, clock: clock.NewFake(time.Date(2026, 12, 1, 9, 0, 0, 0, time.UTC))}
	cfg.API, cfg.Clock = http.NotFoundHandler(), f.clock
	c, err := console.New(cfg)
	must(t, err)
	f.c = c
	rec := httptest.NewRecorder()
	c.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/console/signin", nil))
	for _, ck := range rec.Result().Cookies() {
		if ck.Name == "bc_console_pre" {
			f.pre = ck
		}
	}
	m := csrfField.FindStringSubmatch(rec.Body.String())
	if f.pre == nil || m == nil {
		t.Fatalf("no sign-in form: %s", rec.Body.String())
	}
	f.csrf = m[1]
	return f
}

// signIn posts the sign-in form from addr and returns the answer's status
// and session cookie.
func (f *fakeConsole) signIn(key, addr string) (int, *http.Cookie) {
	r := httptest.NewRequest(http.MethodPost, "/console/signin", strings.NewReader(url.Values{"csrf": {f.csrf}, "key": {key}}.Encode()))
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	r.RemoteAddr = addr
	r.AddCookie(f.pre)
	rec := httptest.NewRecorder()
	f.c.ServeHTTP(rec, r)
	for _, ck := range rec.Result().Cookies() {
		if ck.Name == "bc_console" && ck.Value != "" {
			return rec.Code, ck
		}
	}
	return rec.Code, nil
}

// signedIn reports whether the session cookie ck still opens a page.
func (f *fakeConsole) signedIn(ck *http.Cookie) bool {
	r := httptest.NewRequest(http.MethodGet, "/console/nodes", nil)
	r.AddCookie(ck)
	rec := httptest.NewRecorder()
	f.c.ServeHTTP(rec, r)
	return rec.Code != http.StatusSeeOther
}

// R23.3: one key holds at most MaxSessionsPerKey sessions: a further
// sign-in ends that key's oldest, and leaves other keys' sessions alone.
func TestSessionsBoundedPerKeyR23_3(t *testing.T) {
	f := newFakeConsole(t, console.Config{SignInsPerMinute: 1 << 30})
	_, other := f.signIn("key-other", "192.0.2.1:1")
	var cookies []*http.Cookie
	for range 100 {
		code, ck := f.signIn("key-a", "192.0.2.1:1")
		if code != http.StatusSeeOther || ck == nil {
			t.Fatalf("sign-in answered %d", code)
		}
		cookies = append(cookies, ck)
	}
	if got, want := f.c.Sessions(), console.DefaultMaxSessionsPerKey+1; got != want {
		t.Fatalf("%d sessions after 100 sign-ins of one key and one of another, want %d", got, want)
	}
	for i, ck := range cookies {
		if want := i >= 100-console.DefaultMaxSessionsPerKey; f.signedIn(ck) != want {
			t.Errorf("session %d signed in: %v, want %v", i, !want, want)
		}
	}
	if !f.signedIn(other) {
		t.Error("another key's session was ended")
	}
}

// R23.3: 50,000 sign-ins (of one key, then of 20,000 keys) leave at most
// MaxSessions sessions at every point, the newest signed in and the
// oldest ended: the memory they hold is bounded by the count.
func TestSessionsBoundedInTotalR23_3(t *testing.T) {
	f := newFakeConsole(t, console.Config{SignInsPerMinute: 1 << 30})
	var first, last *http.Cookie
	for i := range 50000 {
		key := "key-one"
		if i >= 1000 {
			key = fmt.Sprintf("key-%d", i%20000)
		}
		code, ck := f.signIn(key, "192.0.2.1:1")
		if code != http.StatusSeeOther || ck == nil {
			t.Fatalf("sign-in %d answered %d", i, code)
		}
		if i == 1000 {
			first = ck
		}
		last = ck
		if i%1000 == 999 {
			if n := f.c.Sessions(); n > console.DefaultMaxSessions {
				t.Fatalf("%d sessions after %d sign-ins, the bound is %d", n, i+1, console.DefaultMaxSessions)
			}
		}
	}
	if n := f.c.Sessions(); n != console.DefaultMaxSessions {
		t.Fatalf("%d sessions, want the bound %d", n, console.DefaultMaxSessions)
	}
	if f.signedIn(first) || !f.signedIn(last) {
		t.Fatalf("oldest signed in %v, newest %v: want the oldest ended", f.signedIn(first), f.signedIn(last))
	}
}

// R23.3: Run drops expired sessions on the console's clock, with no
// sign-in or page view to trigger it, and stops with its context.
func TestSessionsSweptR23_3(t *testing.T) {
	f := newFakeConsole(t, console.Config{SignInsPerMinute: 1 << 30, SweepEvery: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f.c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	must(t, f.clock.WaitArmed(wctx, 1))
	for i := range 10 {
		f.signIn(fmt.Sprint("key-", i), "192.0.2.1:1")
	}
	f.clock.Advance(console.SessionTTL - time.Minute)
	f.signIn("key-late", "192.0.2.1:1") // expires 8h after the rest
	if n := f.c.Sessions(); n != 11 {
		t.Fatalf("%d sessions before expiry, want 11", n)
	}
	f.clock.Advance(time.Minute)
	poll.Until(t, 10*time.Second, "the expired sessions swept", func() bool { return f.c.Sessions() == 1 })
	f.clock.Advance(console.SessionTTL)
	poll.Until(t, 10*time.Second, "the last session swept", func() bool { return f.c.Sessions() == 0 })
}

// R23.3: a source address gets SignInsPerMinute sign-in attempts a minute,
// right or wrong (an IPv6 source is its /64); another source is not held
// back, and the next minute admits it again.
func TestSignInRateLimitedR23_3(t *testing.T) {
	f := newFakeConsole(t, console.Config{SignInsPerMinute: 3})
	for _, tc := range []struct {
		addr    string
		advance time.Duration
		want    int
	}{
		{"192.0.2.1:1000", 0, http.StatusSeeOther},
		{"192.0.2.1:1001", 0, http.StatusSeeOther},
		{"192.0.2.1:1002", 0, http.StatusSeeOther},
		{"192.0.2.1:1003", 0, http.StatusTooManyRequests},
		{"192.0.2.2:1000", 0, http.StatusSeeOther},
		{"[2001:db8:1:2::1]:1", 0, http.StatusSeeOther},
		{"[2001:db8:1:2::2]:1", 0, http.StatusSeeOther},
		{"[2001:db8:1:2:ffff::3]:1", 0, http.StatusSeeOther},
		{"[2001:db8:1:2::4]:1", 0, http.StatusTooManyRequests},
		{"192.0.2.1:1004", time.Minute, http.StatusSeeOther},
	} {
		f.clock.Advance(tc.advance)
		if code, _ := f.signIn("key", tc.addr); code != tc.want {
			t.Errorf("sign-in from %s: %d, want %d", tc.addr, code, tc.want)
		}
	}
}
