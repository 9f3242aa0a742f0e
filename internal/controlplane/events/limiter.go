package events

import (
	"context"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Limiter rate-limits security events per key (the identity core keys
// refusals by tenant, kind, attestor and reason): at most Per events each
// Window. What it drops is counted, and the next event let through reports
// that count as `suppressed`, so a flood of refused joins costs a bounded
// number of rows and still shows its size.
//
// The count lives in the database (store.Tx.CountLimited, one atomic upsert
// in the transaction that publishes the event), so every API replica on one
// database shares it: three replicas admit 60 a minute, not 180 (R4.7).
// A window starts with the first event after the previous one ended, on the
// limiter's clock.
//
// The in-memory part is only a cache that never admits: once the database
// said a key's window is full, this replica drops the key's events until
// that window ends without asking again (a flood stays off the key's row),
// and hands the number it dropped to the database with its next count of
// the key. So the sum of `suppressed` over a key's events is exact; the
// share a replica dropped from its cache appears in the first event after
// that replica next sees the key (lost if the replica dies first).
type Limiter struct {
	clock  clock.Clock
	per    int
	window time.Duration

	mu   sync.Mutex
	full map[string]*fullWindow
}

// fullWindow is a key whose window the database said is full.
type fullWindow struct {
	until   time.Time
	dropped int
}

// NewLimiter returns a Limiter allowing per events each window.
func NewLimiter(c clock.Clock, per int, window time.Duration) *Limiter {
	if c == nil {
		c = clock.Real{}
	}
	return &Limiter{clock: c, per: per, window: window, full: map[string]*fullWindow{}}
}

// Allow counts an event for key in tx and reports whether it may be
// published in that transaction and, when it may, how many of the key's
// events were suppressed since the last one published. An error leaves the
// event unpublished; the transaction should be abandoned.
func (l *Limiter) Allow(ctx context.Context, tx *store.Tx, key string) (ok bool, suppressed int, err error) {
	now := l.clock.Now()
	l.mu.Lock()
	if l.dropLocked(key, now) {
		l.mu.Unlock()
		return false, 0, nil
	}
	f := l.full[key]
	add := 0
	if f != nil {
		// The window ended: this count takes the dropped ones along.
		add = f.dropped
		delete(l.full, key)
	}
	l.mu.Unlock()
	c, err := tx.CountLimited(ctx, key, now, l.window, l.per, add)
	if err != nil {
		l.keep(key, time.Time{}, add)
		return false, 0, err
	}
	if !c.Admitted {
		// SECURITY: caching a denial can only drop more, never admit more
		// than the database would.
		l.keep(key, c.WindowStart.Add(l.window), 0)
		return false, 0, nil
	}
	return true, c.Carried, nil
}

// Drop reports whether this replica already knows key's window is full,
// counting the event as dropped when it is. A caller checks it before
// opening a transaction for Allow, so a flood costs no database work.
func (l *Limiter) Drop(key string) bool {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dropLocked(key, now)
}

func (l *Limiter) dropLocked(key string, now time.Time) bool {
	f := l.full[key]
	if f != nil && now.Before(f.until) {
		f.dropped++
		return true
	}
	return false
}

// keep records dropped events of key to hand over with its next count and,
// when until is set, that its window is full until then.
func (l *Limiter) keep(key string, until time.Time, dropped int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.full[key]
	if f == nil {
		if len(l.full) > 10000 {
			l.gc()
		}
		f = &fullWindow{}
		l.full[key] = f
	}
	f.dropped += dropped
	if until.After(f.until) {
		f.until = until
	}
}

// gc drops ended windows with nothing dropped.
func (l *Limiter) gc() {
	now := l.clock.Now()
	for k, f := range l.full {
		if !now.Before(f.until) && f.dropped == 0 {
			delete(l.full, k)
		}
	}
}
