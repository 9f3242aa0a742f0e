package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R15.4: what an unauthenticated caller can make the server write is
// bounded. Per key, a window admits per lines and counts the rest; the next
// line admitted after the window ends reports them, once.
func TestLimiterWindow(t *testing.T) {
	c := clock.NewFake(time.Unix(1_700_000_000, 0))
	l := New(c, 3, time.Minute)
	tests := []struct {
		name       string
		advance    time.Duration
		key        string
		events     int
		admitted   int
		suppressed []int // reported by the admitted events, in order
	}{
		{"a flood: 3 of 4000 admitted", 0, "a", 4000, 3, []int{0, 0, 0}},
		{"another key has its own window", 0, "b", 2, 2, []int{0, 0}},
		{"the window still full a second before its end", 59 * time.Second, "a", 10, 0, nil},
		{"the next window reports the dropped once", time.Second, "a", 5, 3, []int{4007, 0, 0}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c.Advance(tc.advance)
			var got []int
			for range tc.events {
				if ok, n := l.Allow(tc.key); ok {
					got = append(got, n)
				}
			}
			if len(got) != tc.admitted || fmt.Sprint(got) != fmt.Sprint(tc.suppressed) {
				t.Errorf("admitted %d reporting %v, want %d reporting %v", len(got), got, tc.admitted, tc.suppressed)
			}
		})
	}
}

// R15.4: keys are capped: a caller minting keys shares one window past
// maxKeys, so the lines stay bounded; ended windows make room again.
func TestLimiterKeyCap(t *testing.T) {
	c := clock.NewFake(time.Unix(1_700_000_000, 0))
	l := New(c, 1, time.Minute)
	admitted := 0
	for i := range 3 * maxKeys {
		if ok, _ := l.Allow(fmt.Sprint("k", i)); ok {
			admitted++
		}
	}
	if admitted != maxKeys+1 { // maxKeys own windows, then one shared
		t.Errorf("admitted %d of %d distinct keys, want %d", admitted, 3*maxKeys, maxKeys+1)
	}
	if len(l.keys) > maxKeys+1 {
		t.Errorf("%d windows held, want at most %d", len(l.keys), maxKeys+1)
	}
	c.Advance(time.Minute)
	if ok, _ := l.Allow("new"); !ok {
		t.Error("a new key was refused after every window ended")
	}
}

// R15.4: net/http's error lines (TLS handshake failures, timeouts) are
// written through the limiter by kind, naming the peer; a flood of them
// from many peers is a bounded number of lines, the next saying how many
// were suppressed.
func TestErrorLog(t *testing.T) {
	c := clock.NewFake(time.Unix(1_700_000_000, 0))
	var buf bytes.Buffer
	lg := NewLogger(slog.New(slog.NewJSONHandler(&buf, nil)), New(c, 2, time.Minute)).ErrorLog(slog.LevelWarn, "api")
	for i := range 100 {
		lg.Printf("http: TLS handshake error from 10.0.%d.%d:5123: EOF", i/256, i%256)
	}
	lg.Printf("http2: server: error reading preface from client [2001:db8::1]:443: timeout")
	c.Advance(time.Minute)
	lg.Printf("http: TLS handshake error from 192.0.2.9:4000: remote error: tls: bad certificate")
	type line struct {
		Msg, Peer, Err string
		Suppressed     int
	}
	var got []line
	for _, s := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var l line
		if err := json.Unmarshal([]byte(s), &l); err != nil {
			t.Fatalf("line %q: %v", s, err)
		}
		got = append(got, l)
	}
	want := []line{
		{"http: TLS handshake error", "10.0.0.0:5123", "EOF", 0},
		{"http: TLS handshake error", "10.0.0.1:5123", "EOF", 0},
		{"http2: server: error reading preface", "[2001:db8::1]:443", "timeout", 0},
		{"http: TLS handshake error", "192.0.2.9:4000", "remote error: tls: bad certificate", 98},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("lines\n%v\nwant\n%v", got, want)
	}
}
