package clock_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// got returns the value waiting on c, if any, without blocking: the fake
// fires synchronously inside Advance, so after Advance returns a fired
// timer's value is already in its channel.
func got(c <-chan time.Time) (time.Time, bool) {
	select {
	case v := <-c:
		return v, true
	default:
		return time.Time{}, false
	}
}

func TestFakeTimer(t *testing.T) {
	f := clock.NewFake(t0)
	tm := f.NewTimer(10 * time.Second)
	if f.Armed() != 1 {
		t.Fatalf("armed %d, want 1", f.Armed())
	}
	f.Advance(9 * time.Second)
	if _, ok := got(tm.C()); ok {
		t.Fatal("fired before its time")
	}
	f.Advance(time.Second)
	v, ok := got(tm.C())
	if !ok || !v.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("fired %v %v, want at %v", v, ok, t0.Add(10*time.Second))
	}
	if f.Armed() != 0 {
		t.Fatalf("a fired timer is still armed")
	}
	if tm.Stop() {
		t.Error("Stop of a fired timer reports it pending")
	}
	// Reset re-arms; Stop disarms and reports it.
	if tm.Reset(time.Second) {
		t.Error("Reset of a fired timer reports it pending")
	}
	if !tm.Stop() {
		t.Error("Stop of a pending timer reports it not pending")
	}
	f.Advance(time.Hour)
	if _, ok := got(tm.C()); ok {
		t.Error("a stopped timer fired")
	}
}

// Stop and Reset empty the channel: no stale value after them.
func TestFakeTimerResetDrains(t *testing.T) {
	f := clock.NewFake(t0)
	tm := f.NewTimer(time.Second)
	f.Advance(time.Second) // fired, not read
	tm.Reset(5 * time.Second)
	if _, ok := got(tm.C()); ok {
		t.Fatal("stale value after Reset")
	}
	f.Advance(5 * time.Second)
	if v, ok := got(tm.C()); !ok || !v.Equal(t0.Add(6*time.Second)) {
		t.Fatalf("after Reset fired %v %v", v, ok)
	}
}

func TestFakeTimerZeroFiresAtOnce(t *testing.T) {
	f := clock.NewFake(t0)
	tm := f.NewTimer(0)
	if v, ok := got(tm.C()); !ok || !v.Equal(t0) {
		t.Fatalf("zero timer: %v %v", v, ok)
	}
	if f.Armed() != 0 {
		t.Fatal("a fired zero timer is armed")
	}
}

// A ticker fires at every period passed, in order with other timers;
// Now reads each one's time as it fires; ticks not read are dropped.
func TestFakeTickerAndOrder(t *testing.T) {
	f := clock.NewFake(t0)
	var mu sync.Mutex
	var order []string
	var at []time.Time
	tk := f.NewTicker(3 * time.Second)
	defer tk.Stop()
	f.AfterFunc(4*time.Second, func() {
		mu.Lock()
		order = append(order, "func")
		at = append(at, f.Now())
		mu.Unlock()
	})
	f.Advance(3 * time.Second)
	if v, ok := got(tk.C()); !ok || !v.Equal(t0.Add(3*time.Second)) {
		t.Fatalf("tick %v %v", v, ok)
	}
	f.Advance(4 * time.Second) // t0+7: the func at 4, a tick at 6 (read below)
	mu.Lock()
	if len(order) != 1 || !at[0].Equal(t0.Add(4*time.Second)) {
		t.Errorf("AfterFunc ran %v at %v, want once at t0+4s", order, at)
	}
	mu.Unlock()
	if v, ok := got(tk.C()); !ok || !v.Equal(t0.Add(6*time.Second)) {
		t.Fatalf("tick %v %v, want t0+6s", v, ok)
	}
	// Not read: the channel holds the first, later ones drop.
	f.Advance(9 * time.Second) // ticks at 9, 12, 15
	if v, ok := got(tk.C()); !ok || !v.Equal(t0.Add(9*time.Second)) {
		t.Fatalf("kept tick %v %v, want t0+9s", v, ok)
	}
	if _, ok := got(tk.C()); ok {
		t.Fatal("more than one tick kept")
	}
	tk.Reset(time.Minute)
	f.Advance(59 * time.Second)
	if _, ok := got(tk.C()); ok {
		t.Fatal("tick before the reset period")
	}
	f.Advance(time.Second)
	if _, ok := got(tk.C()); !ok {
		t.Fatal("no tick after the reset period")
	}
	tk.Stop()
	f.Advance(time.Hour)
	if _, ok := got(tk.C()); ok {
		t.Fatal("a stopped ticker ticked")
	}
	if f.Armed() != 0 {
		t.Fatalf("armed %d after everything stopped or fired", f.Armed())
	}
}

// Set moves back without firing, and forward firing what passed.
func TestFakeSet(t *testing.T) {
	f := clock.NewFake(t0)
	tm := f.NewTimer(time.Minute)
	f.Set(t0.Add(-time.Hour))
	if !f.Now().Equal(t0.Add(-time.Hour)) {
		t.Fatalf("Now %v", f.Now())
	}
	if _, ok := got(tm.C()); ok {
		t.Fatal("moving back fired a timer")
	}
	f.Set(t0.Add(2 * time.Minute))
	if _, ok := got(tm.C()); !ok {
		t.Fatal("Set past the timer did not fire it")
	}
	if d := f.Since(t0); d != 2*time.Minute {
		t.Errorf("Since %v", d)
	}
}

// WaitArmed lets a test advance only once a goroutine waits, so the
// advance cannot come first; concurrent use is race-free.
func TestFakeWaitArmed(t *testing.T) {
	f := clock.NewFake(t0)
	var woke atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if clock.Sleep(f, nil, time.Minute) {
				woke.Add(1)
			}
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.WaitArmed(ctx, 8); err != nil {
		t.Fatalf("8 sleepers never armed: %v (armed %d)", err, f.Armed())
	}
	f.Advance(time.Minute)
	wg.Wait()
	if woke.Load() != 8 {
		t.Fatalf("%d of 8 woke", woke.Load())
	}
	// WaitArmed ends with its context.
	short, c2 := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer c2()
	if err := f.WaitArmed(short, 1); err == nil {
		t.Fatal("WaitArmed returned with nothing armed")
	}
}

// Sleep ends early when done closes.
func TestSleepDone(t *testing.T) {
	f := clock.NewFake(t0)
	done := make(chan struct{})
	res := make(chan bool, 1)
	go func() { res <- clock.Sleep(f, done, time.Hour) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.WaitArmed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	close(done)
	if <-res {
		t.Fatal("Sleep reported the full wait after done closed")
	}
	if f.Armed() != 0 {
		t.Fatal("Sleep left its timer armed")
	}
}

// The zero Fake is usable and reads the zero time.
func TestFakeZero(t *testing.T) {
	var f clock.Fake
	tm := f.NewTimer(time.Second)
	f.Advance(time.Second)
	if v, ok := got(tm.C()); !ok || !v.Equal(time.Time{}.Add(time.Second)) {
		t.Fatalf("%v %v", v, ok)
	}
}

// Real's timers are time's.
func TestReal(t *testing.T) {
	var c clock.Clock = clock.Real{}
	tm := c.NewTimer(time.Millisecond)
	select {
	case <-tm.C():
	case <-time.After(10 * time.Second):
		t.Fatal("real timer did not fire")
	}
	done := make(chan struct{})
	c.AfterFunc(time.Millisecond, func() { close(done) })
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("real AfterFunc did not run")
	}
	tk := c.NewTicker(time.Millisecond)
	<-tk.C()
	tk.Stop()
	if c.Since(c.Now().Add(-time.Second)) < time.Second {
		t.Error("Since is short")
	}
}
