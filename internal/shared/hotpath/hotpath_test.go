package hotpath

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sync"
	"testing"
	"time"
)

// The pool is a performance seam under the agent listener and the gateway:
// these tests check that it changes nothing a handler can see.

func TestRunRunsAndWaits(t *testing.T) {
	p := New(4, 0)
	for i := range 100 {
		got := -1
		p.Run(func() { got = i })
		if got != i {
			t.Fatalf("run %d: f's effect not visible after Run: %d", i, got)
		}
	}
	if n := p.Workers(); n < 1 || n > 4 {
		t.Fatalf("workers %d, want 1..4", n)
	}
}

func TestRunRaisesPanicInCaller(t *testing.T) {
	p := New(2, 0)
	for _, v := range []any{"boom", http.ErrAbortHandler, errors.New("x")} {
		func() {
			defer func() {
				if r := recover(); r != v {
					t.Fatalf("recovered %v, want %v", r, v)
				}
			}()
			p.Run(func() { panic(v) })
			t.Fatalf("Run returned after a panic")
		}()
	}
	// The workers survived and still run work.
	ran := false
	p.Run(func() { ran = true })
	if !ran {
		t.Fatal("pool stopped working after panics")
	}
}

func TestRunSurvivesGoexit(t *testing.T) {
	p := New(1, 0)
	p.Run(runtime.Goexit)
	waitFor(t, func() bool { return p.Workers() == 0 })
	ran := false
	p.Run(func() { ran = true })
	if !ran {
		t.Fatal("pool stopped working after a Goexit")
	}
}

// A pool never queues: with every worker busy, Run runs f on the caller.
func TestRunNeverQueues(t *testing.T) {
	const max = 3
	p := New(max, 0)
	release := make(chan struct{})
	var busy sync.WaitGroup
	for range max {
		busy.Add(1)
		started := make(chan struct{})
		go p.Run(func() { close(started); <-release; busy.Done() })
		<-started
	}
	if n := p.Workers(); n != max {
		t.Fatalf("workers %d, want %d", n, max)
	}
	ran := false
	p.Run(func() { ran = true }) // would block forever if it queued
	if !ran {
		t.Fatal("f did not run")
	}
	if n := p.Workers(); n != max {
		t.Fatalf("workers %d past the limit %d", n, max)
	}
	close(release)
	busy.Wait()
}

func TestIdleWorkersExit(t *testing.T) {
	p := New(8, 10*time.Millisecond)
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); p.Run(func() { time.Sleep(time.Millisecond) }) }()
	}
	wg.Wait()
	waitFor(t, func() bool { return p.Workers() == 0 })
}

// The join path's handler sees the same request and writes the same
// answer through the pool, streaming flushes included.
func TestHandler(t *testing.T) {
	p := New(4, 0)
	h := p.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Path", r.URL.Path)
		w.WriteHeader(http.StatusTeapot)
		_, _ = w.Write([]byte("a"))
		if err := http.NewResponseController(w).Flush(); err != nil {
			t.Errorf("flush: %v", err)
		}
		_, _ = w.Write([]byte("b"))
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	for range 20 {
		res, err := http.Get(srv.URL + "/x/y")
		if err != nil {
			t.Fatal(err)
		}
		var b [8]byte
		n, _ := res.Body.Read(b[:])
		m, _ := res.Body.Read(b[n:])
		res.Body.Close()
		if res.StatusCode != http.StatusTeapot || res.Header.Get("X-Path") != "/x/y" || string(b[:n+m]) != "ab" {
			t.Fatalf("status %d path %q body %q", res.StatusCode, res.Header.Get("X-Path"), b[:n+m])
		}
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
		time.Sleep(time.Millisecond)
	}
}

// deep uses about 24 KiB of stack, like a join's handler.
//
//go:noinline
func deep(n int) byte {
	var b [512]byte
	b[n%512] = byte(n)
	if n == 0 {
		return b[0]
	}
	return deep(n-1) + b[n%512]
}

// BenchmarkDeepCall compares a deep call on a new goroutine (what net/http
// does per stream) with the same call handed to the pool.
func BenchmarkDeepCall(b *testing.B) {
	b.Run("new-goroutine", func(b *testing.B) {
		for range b.N {
			done := make(chan struct{})
			go func() { deep(40); close(done) }()
			<-done
		}
	})
	b.Run("pool", func(b *testing.B) {
		p := New(4, 0)
		for range b.N {
			done := make(chan struct{})
			go func() { p.Run(func() { deep(40) }); close(done) }()
			<-done
		}
	})
}
