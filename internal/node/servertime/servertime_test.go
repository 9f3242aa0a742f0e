package servertime

import (
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R19.3: the offset is learned from the server's time, persisted so a new
// Offset (a restart) keeps it, bounded, and ignored when not told.
func TestOffsetR19_3(t *testing.T) {
	now := time.Now().Truncate(time.Millisecond)
	for _, tc := range []struct {
		name     string
		serverMs int64
		want     time.Duration
		refused  bool
	}{
		{name: "behind", serverMs: now.Add(time.Hour).UnixMilli(), want: time.Hour},
		{name: "agrees", serverMs: now.Add(5 * time.Millisecond).UnixMilli(), want: 5 * time.Millisecond},
		{name: "ahead", serverMs: now.Add(-3 * time.Minute).UnixMilli(), want: -3 * time.Minute},
		{name: "not told", serverMs: 0, want: 0},
		{name: "beyond the bound", serverMs: now.Add(MaxOffset + time.Hour).UnixMilli(), want: 0, refused: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			c := clock.NewFake(now)
			o := New(Config{Dir: dir, Clock: c})
			if _, err := o.Learn(tc.serverMs); (err != nil) != tc.refused {
				t.Fatalf("Learn: %v, refused want %v", err, tc.refused)
			}
			again := New(Config{Dir: dir, Clock: c})
			if got, _ := again.Offset(); got != tc.want {
				t.Fatalf("offset after a restart %s, want %s", got, tc.want)
			}
			c.Advance(time.Minute)
			if got := again.Now(); !got.Equal(now.Add(time.Minute + tc.want)) {
				t.Fatalf("Now %s, want %s", got, now.Add(time.Minute+tc.want))
			}
		})
	}
}

// R19.3: the message of a refusal names the clock when it is off the
// control plane's.
func TestDescribeNamesTheClockR19_3(t *testing.T) {
	for _, tc := range []struct {
		off  time.Duration
		want string
	}{
		{time.Hour, "1h0m0s behind the control plane's; fix NTP"},
		{-3 * time.Minute, "3m0s ahead of the control plane's; fix NTP"},
		{0, "agrees"},
	} {
		if got := Describe(tc.off); !strings.Contains(got, tc.want) {
			t.Errorf("Describe(%s) = %q, want %q", tc.off, got, tc.want)
		}
	}
}
