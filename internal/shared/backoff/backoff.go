// Package backoff is the one exponential backoff of every retry loop in
// the product: bcd's join, renewal and session loops, the API's command
// notification listener, and the store's transaction retries. A Policy is
// a minimum doubling up to a maximum; Wait sleeps on the injected clock
// and ends early with its context, so loops are tested by moving a fake
// clock. Jitter, where a loop wants it, is the loop's own.
//
// It imports only internal/shared/clock: anything, on either side, may use it.
package backoff

import (
	"context"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Policy is an exponential backoff: Min after the first failure, doubling
// after each further one, never past Max.
type Policy struct {
	Min, Max time.Duration
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
