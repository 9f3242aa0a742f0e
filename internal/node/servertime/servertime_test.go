package servertime

import (
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
