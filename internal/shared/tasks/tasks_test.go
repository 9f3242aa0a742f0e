package tasks

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// Close returns only once the tasks started before it ended, and refuses
// tasks and requests after it.
func TestCloseWaitsAndRefuses(t *testing.T) {
	var tr Tracker
	release, started := make(chan struct{}), make(chan struct{})
	var finished atomic.Bool
	if !tr.Go(func() { close(started); <-release; finished.Store(true) }) {
		t.Fatal("Go refused before Close")
	}
	<-started
	served := false
	h := tr.Handler(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { served = true }), "stopping")
	closed := make(chan struct{})
	go func() { tr.Close(); close(closed) }()
	close(release)
	<-closed
	if !finished.Load() {
		t.Fatal("Close returned before the task ended")
	}
	if tr.Go(func() { t.Error("a task ran after Close") }) {
		t.Fatal("Go accepted a task after Close")
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/", nil))
	if served || w.Code != http.StatusServiceUnavailable {
		t.Fatalf("a request after Close: served %v, %d", served, w.Code)
	}
	tr.Close() // again: nothing to wait for
}
