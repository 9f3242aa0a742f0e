// Package backoff is the one exponential backoff of every retry loop in
// the product: bcd's join, renewal and session loops, the API's command
// notification listener, and the store's transaction retries. A Policy is
// a minimum doubling up to a maximum; Wait sleeps on the injected clock
// and ends early with its context, so loops are tested by moving a fake
// clock. Spread adds jitter, so a fleet that failed at once (a rack that
// booted together, every daemon of a gateway that restarted) does not
// retry in lockstep: bcd's join, renewal and session loops and the audit
// exporter use it with DefaultJitter.
//
// It imports only internal/shared/clock: anything, on either side, may use it.
package backoff

import (
	"context"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// DefaultJitter is the jitter of the product's retry loops: each wait is
// spread over ±20% of its delay.
const DefaultJitter = 0.2

// Policy is an exponential backoff: Min after the first failure, doubling
// after each further one, never past Max. Jitter, a fraction in [0, 1),
// spreads Spread's waits over ±Jitter of the delay.
type Policy struct {
	Min, Max time.Duration
	Jitter   float64
}

// Spread is Delay(n) spread by the jitter: r, a random number in [0, 1)
// (math/rand/v2's Float64, or a fixed one in tests), picks the factor
// between 1-Jitter and 1+Jitter; r = 0.5 is Delay(n) itself.
func (p Policy) Spread(n int, r float64) time.Duration {
	d := p.Delay(n)
	if p.Jitter <= 0 || p.Jitter >= 1 {
		return d
	}
	r = min(max(r, 0), 1)
	return time.Duration(float64(d) * (1 - p.Jitter + 2*p.Jitter*r))
}

// Delay is the wait after the n-th failure in a row (n ≥ 1; smaller n
// counts as 1).
func (p Policy) Delay(n int) time.Duration {
	if p.Min <= 0 {
		return 0
	}
	d := p.Min
	for i := 1; i < n && d < p.Max; i++ {
		d *= 2
	}
	return min(d, max(p.Max, p.Min))
}

// Wait sleeps Delay(n) on c. It returns ctx's error, at once, when ctx ends
// first, and nil after the full wait.
func (p Policy) Wait(ctx context.Context, c clock.Clock, n int) error {
	if c == nil {
		c = clock.Real{}
	}
	if !clock.Sleep(c, ctx.Done(), p.Delay(n)) {
		return ctx.Err()
	}
	return nil
}
