package renew_test

import (
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// R19.3: bcd joins through the real gateway and API with its clock minutes
// or an hour off the control plane's: the seal's iat is accepted within
// its window, and beyond it the refused join is sent once more dated by the
// control plane's time (the Keys answer). A clock an hour behind sees the
// gateway's fresh certificate as not yet valid, and says to fix the clock.
func TestJoinClockSkewR19_3(t *testing.T) {
	for _, tc := range []struct {
		skew    time.Duration // the control plane's clock minus bcd's
		refused string        // set: the join fails naming the clock
	}{
		{skew: time.Hour, refused: "clock is off the control plane's, fix NTP"},
		{skew: 3 * time.Minute},
		{skew: -3 * time.Minute},
		{skew: -time.Hour},
	} {
		t.Run(tc.skew.String(), func(t *testing.T) {
			apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
				s := newStackWith(t, e, stackOptions{joinClock: clock.NewFake(time.Now().Add(-tc.skew))})
				if tc.refused != "" {
					if s.joinErr == nil || !strings.Contains(s.joinErr.Error(), tc.refused) {
						t.Fatalf("join with the clock %s off: %v, want %q", tc.skew, s.joinErr, tc.refused)
					}
					return
				}
				if s.joinErr != nil {
					t.Fatalf("join with the clock %s off: %v", tc.skew, s.joinErr)
				}
				off, _, err := servertime.Read(s.store.Dir)
				if err != nil || (off-tc.skew).Abs() > 5*time.Second {
					t.Fatalf("learned offset %s (%v), want about %s", off, err, tc.skew)
				}
			})
		})
	}
}
