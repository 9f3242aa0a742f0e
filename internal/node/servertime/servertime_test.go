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

// R21.4: an unsigned hint dates what bcd stamps until the next signed
// answer, and nothing else: Now (command expiry) and the persisted offset
// ignore it; and a certificate counts as expired only when this machine's
// own clock agrees with the offset.
func TestHintAndExpiryR21_4(t *testing.T) {
	now := time.Now().Truncate(time.Millisecond)
	dir := t.TempDir()
	c := clock.NewFake(now)
	o := New(Config{Dir: dir, Clock: c})
	if moved := o.Hint(now.Add(-10*time.Minute).UnixMilli(), 30*time.Second); !moved {
		t.Error("a hint 10 minutes off: not moved")
	}
	if got := o.StampNow(); !got.Equal(now.Add(-10 * time.Minute)) {
		t.Errorf("StampNow = %s, want the hinted time", got)
	}
	if got := o.Now(); !got.Equal(now) {
		t.Errorf("Now = %s: a hint moved the clock commands are checked by", got)
	}
	if _, _, err := Read(dir); err == nil {
		t.Error("a hint was persisted")
	}
	if o.Hint(now.Add(-10*time.Minute+time.Second).UnixMilli(), 30*time.Second) {
		t.Error("a second hint one second from the first: moved")
	}
	if o.Hint(now.Add(MaxOffset+time.Hour).UnixMilli(), 30*time.Second) {
		t.Error("a hint beyond the bound: moved")
	}
	// The next signed answer replaces the hint.
	if _, err := o.Learn(now.Add(2 * time.Minute).UnixMilli()); err != nil {
		t.Fatal(err)
	}
	if got := o.StampNow(); !got.Equal(now.Add(2 * time.Minute)) {
		t.Errorf("StampNow after a signed answer = %s", got)
	}

	notAfter := now.Add(time.Minute)
	for _, tc := range []struct {
		name    string
		offset  time.Duration
		advance time.Duration
		want    bool
	}{
		{name: "valid by both", offset: 0, want: false},
		{name: "expired by the offset only", offset: 2 * time.Minute, want: false},
		{name: "expired by this machine's clock only", offset: -2 * time.Minute, advance: 90 * time.Second, want: false},
		{name: "expired by both", offset: time.Minute, advance: 2 * time.Minute, want: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := clock.NewFake(now)
			o := New(Config{Clock: c})
			if _, err := o.Learn(now.Add(tc.offset).UnixMilli()); err != nil {
				t.Fatal(err)
			}
			c.Advance(tc.advance)
			if got := o.Expired(notAfter); got != tc.want {
				t.Errorf("Expired = %v, want %v", got, tc.want)
			}
		})
	}
}
