// Package clock is the time source every service takes as a dependency:
// the current time, and the timers and tickers that loops wait on (the
// shape of Tailscale's tstime.Clock). Any package may import it.
//
// Domain code never calls time.Now, time.NewTimer or time.NewTicker:
// expiry decisions that must agree across replicas are made by the
// database's compute_now(), and the rest (certificate validity, renewal
// proofs, rate-limit windows, heartbeats, polls, backoff) read a Clock, so
// tests move time with Fake instead of sleeping.
package clock

import (
	"time"
)

// Clock tells the time and makes timers that fire by it.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// Since returns the time elapsed since t (Now().Sub(t)).
	Since(t time.Time) time.Duration
	// NewTimer returns a timer that sends the time on its channel once,
	// after d.
	NewTimer(d time.Duration) Timer
	// NewTicker returns a ticker that sends the time on its channel every
	// d; d must be positive. Ticks a slow reader misses are dropped.
	NewTicker(d time.Duration) Ticker
	// AfterFunc calls f in its own goroutine after d. The timer's C is
	// nil.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a time.Timer of a Clock.
type Timer interface {
	// C is the channel the time is sent on (nil for AfterFunc).
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it stopped
	// a pending timer.
	Stop() bool
	// Reset makes the timer fire after d; it reports whether the timer was
	// pending.
	Reset(d time.Duration) bool
}

// Ticker is a time.Ticker of a Clock.
type Ticker interface {
	// C is the channel the ticks are sent on.
	C() <-chan time.Time
	// Stop turns the ticker off.
	Stop()
	// Reset stops the ticker and restarts it with period d.
	Reset(d time.Duration)
}

// Real is the wall clock.
type Real struct{}

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// Since returns time.Since(t).
func (Real) Since(t time.Time) time.Duration { return time.Since(t) }

// NewTimer wraps time.NewTimer.
func (Real) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

// NewTicker wraps time.NewTicker.
func (Real) NewTicker(d time.Duration) Ticker { return realTicker{time.NewTicker(d)} }

// AfterFunc wraps time.AfterFunc.
func (Real) AfterFunc(d time.Duration, f func()) Timer { return realTimer{time.AfterFunc(d, f)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time        { return r.t.C }
func (r realTimer) Stop() bool                 { return r.t.Stop() }
func (r realTimer) Reset(d time.Duration) bool { return r.t.Reset(d) }

type realTicker struct{ t *time.Ticker }

func (r realTicker) C() <-chan time.Time   { return r.t.C }
func (r realTicker) Stop()                 { r.t.Stop() }
func (r realTicker) Reset(d time.Duration) { r.t.Reset(d) }

// Sleep waits d on c, or until done is closed; it reports whether the full
// wait passed. A d of zero or less returns true at once.
func Sleep(c Clock, done <-chan struct{}, d time.Duration) bool {
	if d <= 0 {
		select {
		case <-done:
			return false
		default:
			return true
		}
	}
	t := c.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-done:
		return false
	}
}
