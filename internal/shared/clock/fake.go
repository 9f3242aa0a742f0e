package clock

import (
	"context"
	"sort"
	"sync"
	"time"
)

// Fake is a clock that tests set and advance by hand. Its timers, tickers
// and AfterFunc functions fire when Advance or Set moves the clock past
// their time, in the order of their times (then of their creation), with
// Now reading each one's time as it fires. It is safe for concurrent use.
//
// A timer's or ticker's channel holds one value, like time's: a tick the
// reader has not taken yet makes later ticks drop. Stop and Reset empty
// the channel (time's behaviour since Go 1.23). AfterFunc functions run
// in Advance's goroutine before it returns, one after the other, so they
// must not call Advance or Set themselves; a timer of zero or less fires
// at once (an AfterFunc's function in its own goroutine).
//
// Tests that advance while another goroutine is about to wait use
// WaitArmed: it returns once that many timers and tickers are armed, so
// the advance cannot come before the wait it means to end.
type Fake struct {
	// stepping serializes Advance and Set, so concurrent advances fire
	// timers in one order.
	stepping sync.Mutex

	mu      sync.Mutex
	now     time.Time
	seq     uint64
	armed   map[*fakeTimer]struct{}
	changed chan struct{} // closed and replaced whenever armed changes
}

// NewFake returns a Fake clock reading t.
func NewFake(t time.Time) *Fake {
	return &Fake{now: t, armed: map[*fakeTimer]struct{}{}, changed: make(chan struct{})}
}

// Now returns the fake time.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// Since returns Now().Sub(t).
func (f *Fake) Since(t time.Time) time.Duration { return f.Now().Sub(t) }

// Advance moves the clock forward by d, firing what falls due.
func (f *Fake) Advance(d time.Duration) {
	f.stepping.Lock()
	defer f.stepping.Unlock()
	f.set(f.Now().Add(d))
}

// Set moves the clock to t, firing what falls due on the way. Moving it
// back fires nothing.
func (f *Fake) Set(t time.Time) {
	f.stepping.Lock()
	defer f.stepping.Unlock()
	f.set(t)
}

func (f *Fake) set(t time.Time) {
	for {
		f.mu.Lock()
		next := f.dueLocked(t)
		if next == nil {
			f.now = t
			f.mu.Unlock()
			return
		}
		if next.when.After(f.now) {
			f.now = next.when
		}
		fn := next.fireLocked()
		f.mu.Unlock()
		if fn != nil {
			fn()
		}
	}
}

// dueLocked returns the armed timer that fires first at or before t.
func (f *Fake) dueLocked(t time.Time) *fakeTimer {
	var first *fakeTimer
	for ft := range f.armed {
		if ft.when.After(t) {
			continue
		}
		if first == nil || ft.when.Before(first.when) || ft.when.Equal(first.when) && ft.seq < first.seq {
			first = ft
		}
	}
	return first
}

// Armed returns how many timers and tickers are armed.
func (f *Fake) Armed() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.armed)
}

// Deadlines returns the times at which the armed timers and tickers fire
// next, earliest first (for test failure messages).
func (f *Fake) Deadlines() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]time.Time, 0, len(f.armed))
	for ft := range f.armed {
		out = append(out, ft.when)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
	return out
}

// WaitArmed waits until at least n timers and tickers are armed, or ctx
// ends (returning its error).
func (f *Fake) WaitArmed(ctx context.Context, n int) error {
	for {
		f.mu.Lock()
		f.initLocked()
		ok, ch := len(f.armed) >= n, f.changed
		f.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// initLocked makes the zero Fake usable (it reads the zero time).
func (f *Fake) initLocked() {
	if f.armed == nil {
		f.armed = map[*fakeTimer]struct{}{}
	}
	if f.changed == nil {
		f.changed = make(chan struct{})
	}
}

func (f *Fake) notifyLocked() {
	f.initLocked()
	close(f.changed)
	f.changed = make(chan struct{})
}

// NewTimer returns a timer firing at Now()+d.
func (f *Fake) NewTimer(d time.Duration) Timer {
	ft := &fakeTimer{f: f, ch: make(chan time.Time, 1)}
	ft.Reset(d)
	return ft
}

// NewTicker returns a ticker firing every d from Now(); d must be
// positive.
func (f *Fake) NewTicker(d time.Duration) Ticker {
	if d <= 0 {
		panic("clock: non-positive interval for NewTicker")
	}
	ft := &fakeTimer{f: f, ch: make(chan time.Time, 1)}
	ft.resetTicker(d)
	return fakeTicker{ft}
}

// AfterFunc calls fn when the clock passes Now()+d.
func (f *Fake) AfterFunc(d time.Duration, fn func()) Timer {
	ft := &fakeTimer{f: f, fn: fn}
	ft.Reset(d)
	return ft
}

// fakeTimer is a Fake's timer, ticker (period > 0) or AfterFunc (fn set).
type fakeTimer struct {
	f      *Fake
	ch     chan time.Time
	fn     func()
	period time.Duration
	// guarded by f.mu
	when time.Time
	seq  uint64
}

func (ft *fakeTimer) C() <-chan time.Time { return ft.ch }

// fireLocked fires ft at its time and returns the function to call, if
// any, once f.mu is released.
func (ft *fakeTimer) fireLocked() func() {
	f := ft.f
	at := ft.when
	if ft.period > 0 {
		ft.when = ft.when.Add(ft.period)
	} else {
		delete(f.armed, ft)
		f.notifyLocked()
	}
	if ft.fn != nil {
		return ft.fn
	}
	select {
	case ft.ch <- at:
	default: // the reader has not taken the last tick: drop this one
	}
	return nil
}

func (ft *fakeTimer) drainLocked() {
	if ft.ch == nil {
		return
	}
	select {
	case <-ft.ch:
	default:
	}
}

func (ft *fakeTimer) Stop() bool {
	f := ft.f
	f.mu.Lock()
	defer f.mu.Unlock()
	_, pending := f.armed[ft]
	if pending {
		delete(f.armed, ft)
		f.notifyLocked()
	}
	ft.drainLocked()
	return pending
}

func (ft *fakeTimer) Reset(d time.Duration) bool {
	f := ft.f
	f.mu.Lock()
	defer f.mu.Unlock()
	f.initLocked()
	_, pending := f.armed[ft]
	ft.drainLocked()
	f.seq++
	ft.seq = f.seq
	ft.when = f.now.Add(d)
	if d <= 0 {
		// Like time's, a timer of zero fires at once, without an Advance.
		if pending {
			delete(f.armed, ft)
			f.notifyLocked()
		}
		if ft.fn != nil {
			go ft.fn()
		} else {
			ft.ch <- f.now // drained above: there is room
		}
		return pending
	}
	f.armed[ft] = struct{}{}
	f.notifyLocked()
	return pending
}

func (ft *fakeTimer) resetTicker(d time.Duration) {
	if d <= 0 {
		panic("clock: non-positive interval for Ticker.Reset")
	}
	f := ft.f
	f.mu.Lock()
	defer f.mu.Unlock()
	f.initLocked()
	ft.drainLocked()
	ft.period = d
	f.seq++
	ft.seq = f.seq
	ft.when = f.now.Add(d)
	f.armed[ft] = struct{}{}
	f.notifyLocked()
}

// fakeTicker is the Ticker view of a fakeTimer with a period (Ticker's
// Stop and Reset return nothing).
type fakeTicker struct{ ft *fakeTimer }

func (t fakeTicker) C() <-chan time.Time   { return t.ft.ch }
func (t fakeTicker) Stop()                 { t.ft.Stop() }
func (t fakeTicker) Reset(d time.Duration) { t.ft.resetTicker(d) }
