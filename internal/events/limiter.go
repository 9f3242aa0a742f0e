package events

import (
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/clock"
)

// Limiter rate-limits security events per key (the identity core keys
// refusals by tenant, kind, attestor and reason): at most Per events each
// Window. What it drops is counted, and the next event let
// through reports that count as `suppressed`, so a flood of refused joins
// costs a bounded number of rows and still shows its size. The limit is per
// process: with several API replicas each keeps its own.
type Limiter struct {
	clock  clock.Clock
	per    int
	window time.Duration

	mu sync.Mutex
	m  map[string]*bucket
}

type bucket struct {
	start      time.Time
	n          int
	suppressed int
}

// NewLimiter returns a Limiter allowing per events each window.
func NewLimiter(c clock.Clock, per int, window time.Duration) *Limiter {
	if c == nil {
		c = clock.Real{}
	}
	return &Limiter{clock: c, per: per, window: window, m: map[string]*bucket{}}
}

// Allow reports whether an event for key may be published now and, when it
// may, how many were suppressed since the last one published.
func (l *Limiter) Allow(key string) (ok bool, suppressed int) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.m[key]
	if b == nil {
		if len(l.m) > 10000 {
			l.gc(now)
		}
		b = &bucket{start: now}
		l.m[key] = b
	}
	if now.Sub(b.start) >= l.window {
		b.start, b.n = now, 0
	}
	if b.n >= l.per {
		b.suppressed++
		return false, 0
	}
	b.n++
	s := b.suppressed
	b.suppressed = 0
	return true, s
}

// gc drops idle buckets with nothing suppressed.
func (l *Limiter) gc(now time.Time) {
	for k, b := range l.m {
		if now.Sub(b.start) >= l.window && b.suppressed == 0 {
			delete(l.m, k)
		}
	}
}
