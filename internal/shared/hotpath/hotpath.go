// Package hotpath runs short, deep request handlers on goroutines whose
// stacks have already grown.
//
// net/http starts a goroutine per HTTP/2 stream, and a new goroutine starts
// with a small stack. A join's handler goes deep (Connect, protobuf, TLS
// records, x509 and JOSE parsing), so every request grew its goroutine's
// stack several times, each growth a copy of the whole stack: CPU profiles
// showed runtime.newstack/copystack at 10–13% of the gateway relaying joins
// and about 5% of the API serving them. A Pool keeps worker goroutines
// whose stacks stay grown and hands each request to an idle one; the
// stream's own goroutine waits, shallow.
//
// Only for handlers that end quickly (unary calls): a long-lived stream
// would hold a worker for its whole life. A Pool never queues: when no
// worker is idle it starts one, up to its limit, and past that the request
// runs on its own goroutine as before. Workers idle for a while exit, so a
// quiet process (or a test's many servers) holds none.
package hotpath

import (
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// keepStack is how much stack an idle worker keeps in use. The garbage
// collector halves a goroutine's stack when less than a quarter of it is in
// use, so an idle worker waiting inside a frame of this size keeps a stack
// of up to four times it (32 KiB), enough for a join's deepest path.
const keepStack = 8 << 10

// DefaultWorkers bounds the workers of the agent listener's and the
// gateway's pools: more joins in flight than this run on their own
// goroutines. Each worker keeps up to 32 KiB of stack while it lives.
const DefaultWorkers = 128

// DefaultIdle is how long a worker waits for work before it exits.
const DefaultIdle = 30 * time.Second

// Pool hands functions to worker goroutines. Make one with New.
type Pool struct {
	work chan *task
	max  int32
	n    atomic.Int32 // workers alive
	idle time.Duration
}

type task struct {
	f     func()
	done  chan struct{}
	panic any
}

var tasks = sync.Pool{New: func() any { return &task{done: make(chan struct{}, 1)} }}

// New makes a pool of at most max workers, each exiting after idle
// without work (DefaultIdle when idle is 0). It starts none.
func New(max int, idle time.Duration) *Pool {
	if idle <= 0 {
		idle = DefaultIdle
	}
	return &Pool{work: make(chan *task), max: int32(max), idle: idle}
}

// Run runs f on a worker and returns when f has returned. With no worker
// idle it starts one, and with max already busy it runs f on the calling
// goroutine. A panic in f is raised again in the caller; f calling
// runtime.Goexit ends the worker, and Run returns.
func (p *Pool) Run(f func()) {
	t := tasks.Get().(*task)
	t.f, t.panic = f, nil
	select {
	case p.work <- t:
		<-t.done
	default:
		if !p.spawn() {
			t.f = nil
			tasks.Put(t)
			f()
			return
		}
		go p.worker(t)
		<-t.done
	}
	pv := t.panic
	t.f, t.panic = nil, nil
	tasks.Put(t)
	if pv != nil {
		panic(pv)
	}
}

// Handler serves h's requests through p. The request's goroutine waits for
// the worker, so w and r are used by one goroutine at a time, as net/http
// requires.
func (p *Pool) Handler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.Run(func() { h.ServeHTTP(w, r) })
	})
}

// Workers is how many workers are alive.
func (p *Pool) Workers() int { return int(p.n.Load()) }

func (p *Pool) spawn() bool {
	for {
		n := p.n.Load()
		if n >= p.max {
			return false
		}
		if p.n.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// worker runs t, then whatever it is handed, until it has been idle for
// p.idle.
func (p *Pool) worker(t *task) {
	defer p.n.Add(-1)
	timer := time.NewTimer(p.idle)
	defer timer.Stop()
	for t != nil {
		t.run()
		t = wait(p.work, timer, p.idle)
	}
}

func (t *task) run() {
	// Deferred, so it also runs when f panics or calls runtime.Goexit.
	defer func() {
		t.panic = recover()
		t.done <- struct{}{}
	}()
	t.f()
}

// wait receives the next task, or nil after idle, inside a frame of
// keepStack bytes so that the garbage collector does not shrink the idle
// worker's stack.
//
//go:noinline
func wait(work chan *task, timer *time.Timer, idle time.Duration) *task {
	var pad [keepStack]byte
	touch(pad[:])
	timer.Reset(idle)
	select {
	case t := <-work:
		return t
	case <-timer.C:
		return nil
	}
}

// touch keeps pad a live stack array (not optimized away).
//
//go:noinline
func touch(b []byte) { b[0] = 1 }
