package backoff

import (
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

func TestDelay(t *testing.T) {
	p := Policy{Min: time.Second, Max: 60 * time.Second}
	for _, tc := range []struct {
		n    int
		want time.Duration
	}{
		{-1, time.Second}, {0, time.Second}, {1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second},
		{6, 32 * time.Second}, {7, 60 * time.Second}, {1000, 60 * time.Second},
	} {
		if got := p.Delay(tc.n); got != tc.want {
			t.Errorf("Delay(%d) = %s, want %s", tc.n, got, tc.want)
		}
	}
	if got := (Policy{Min: 5 * time.Second, Max: time.Second}).Delay(3); got != 5*time.Second {
		t.Errorf("a Max under Min: %s, want Min", got)
	}
	if got := (Policy{}).Delay(3); got != 0 {
		t.Errorf("the zero policy waits %s", got)
	}
}

// Wait sleeps on the injected clock: it returns once the fake clock moved
// past the delay, and at once when the context ends.
func TestWait(t *testing.T) {
	clk := clock.NewFake(time.Unix(1000, 0))
	p := Policy{Min: time.Second, Max: time.Minute}
	done := make(chan error, 1)
	go func() { done <- p.Wait(context.Background(), clk, 3) }()
	if err := clk.WaitArmed(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(4 * time.Second)
	if err := <-done; err != nil {
		t.Fatalf("Wait: %v", err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- p.Wait(ctx, clk, 1) }()
	if err := clk.WaitArmed(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("Wait after cancel: %v, want context.Canceled", err)
	}
}

// Spread keeps every wait within ±Jitter of the delay, r = 0.5 being the
// delay itself, so retries of a fleet that failed at once spread out.
func TestSpread(t *testing.T) {
	p := Policy{Min: time.Second, Max: 60 * time.Second, Jitter: DefaultJitter}
	for _, tc := range []struct {
		n    int
		r    float64
		want time.Duration
	}{
		{1, 0.5, time.Second}, {1, 0, 800 * time.Millisecond}, {3, 0.5, 4 * time.Second},
		{3, 1, 4800 * time.Millisecond}, {100, 0, 48 * time.Second},
	} {
		got := p.Spread(tc.n, tc.r)
		if d := got - tc.want; d > time.Microsecond || d < -time.Microsecond {
			t.Errorf("Spread(%d, %v) = %s, want %s", tc.n, tc.r, got, tc.want)
		}
	}
	if got := (Policy{Min: time.Second, Max: time.Minute}).Spread(2, 0); got != 2*time.Second {
		t.Errorf("no jitter: %s", got)
	}
}
