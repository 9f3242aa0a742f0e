package gateway

import "sync"

// tasks are the goroutines a Gateway starts beside net/http's: the health
// checker and its checks, the relayed attempts of a join or renewal, the
// daemon -> API half of each session, the in-process API's handlers, the
// [metrics] listener's serve loop, and the handlers themselves. Shutdown
// closes it and waits for all of them, so nothing the gateway started
// outlives it (in serve's process, the API's store closes after it).
type tasks struct {
	// mu orders every enter before closeAndWait's Wait; enters share it
	// (a call's handler enters on the hot path).
	mu     sync.RWMutex
	wg     sync.WaitGroup
	closed bool
}

// enter counts one task in, unless the gateway stopped: false then, and
// the caller does not start it. Each enter that returned true is matched
// by a leave.
func (t *tasks) enter() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return false
	}
	t.wg.Add(1)
	return true
}

func (t *tasks) leave() { t.wg.Done() }

// goTask runs f on a goroutine of its own, counted; false (and f does not
// run) once the gateway stopped.
func (t *tasks) goTask(f func()) bool {
	if !t.enter() {
		return false
	}
	go func() {
		defer t.leave()
		f()
	}()
	return true
}

// closeAndWait refuses new tasks and returns once every counted one ended.
func (t *tasks) closeAndWait() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.wg.Wait()
}
