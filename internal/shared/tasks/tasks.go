// Package tasks counts the goroutines a component starts while it serves
// (a call's handler, a relayed attempt, a health check), which no errgroup
// of its start can own: Close refuses new ones and returns once every
// counted one ended, so a component's stop can wait for them before it
// closes what they use (a store, a connection pool).
package tasks

import (
	"net/http"
	"sync"
)

// Tracker counts tasks. The zero value is ready; Close ends it.
type Tracker struct {
	// mu orders every Enter before Close's Wait; Enters share it (a
	// call's handler enters on the hot path).
	mu     sync.RWMutex
	wg     sync.WaitGroup
	closed bool
}

// Enter counts one task in, unless the tracker is closed: false then, and
// the caller does not start it. Each Enter that returned true is matched
// by a Leave.
func (t *Tracker) Enter() bool {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return false
	}
	t.wg.Add(1)
	return true
}

// Leave counts one task out.
func (t *Tracker) Leave() { t.wg.Done() }

// Go runs f on a goroutine of its own, counted; false (and f does not
// run) once the tracker is closed.
func (t *Tracker) Go(f func()) bool {
	if !t.Enter() {
		return false
	}
	go func() {
		defer t.Leave()
		f()
	}()
	return true
}

// Close refuses new tasks and returns once every counted one ended.
// Calling it again waits again.
func (t *Tracker) Close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.wg.Wait()
}

// Handler serves h counting each request as a task, so Close waits for
// the handlers still running after a server's graceful shutdown ran out
// of time (http.Server.Close does not wait for them). A request that comes
// after Close is answered 503 with msg.
func (t *Tracker) Handler(h http.Handler, msg string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !t.Enter() {
			http.Error(w, msg, http.StatusServiceUnavailable)
			return
		}
		defer t.Leave()
		h.ServeHTTP(w, r)
	})
}
