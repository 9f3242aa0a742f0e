package poll

import (
	"sync/atomic"
	"testing"
	"time"
)

// Wait returns once the condition holds, and reports a timeout otherwise.
func TestWait(t *testing.T) {
	var n atomic.Int32
	if !Wait(10*time.Second, func() bool { return n.Add(1) >= 3 }) {
		t.Fatal("Wait gave up on a condition that held")
	}
	if n.Load() != 3 {
		t.Fatalf("checked %d times, want 3", n.Load())
	}
	if Wait(0, func() bool { return false }) {
		t.Fatal("Wait reported a condition that never held")
	}
}
