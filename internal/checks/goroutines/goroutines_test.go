package goroutines

import "testing"

func TestParse(t *testing.T) {
	const pkg = "github.com/better-compute/better-compute/internal/x"
	for _, c := range []struct {
		name, block            string
		runs, created, waiting bool
	}{
		{name: "blocked in the module", block: "goroutine 7 [select]:\n" + pkg + ".(*T).loop(0x1)\n\t/src/x/x.go:10 +0x1\ncreated by " + pkg + ".Run in goroutine 1\n\t/src/x/x.go:5 +0x2",
			runs: true, created: true, waiting: true},
		{name: "library code the module started", block: "goroutine 8 [IO wait, 2 minutes]:\nnet/http.(*Server).Serve(0x1)\n\t/go/net/http/server.go:1 +0x1\ncreated by " + pkg + ".serve in goroutine 1\n\t/src/x/x.go:7 +0x2",
			created: true, waiting: true},
		{name: "finishing", block: "goroutine 9 [runnable]:\n" + pkg + ".Run.func1()\n\t/src/x/x.go:12 +0x1\ncreated by golang.org/x/sync/errgroup.(*Group).Go in goroutine 1\n\t/m/errgroup.go:1 +0x2",
			runs: true},
		{name: "a test's fake", block: "goroutine 10 [chan receive]:\n" + pkg + ".(*fake).Join()\n\t/src/x/fake_test.go:3 +0x1\ncreated by net/http.(*Server).Serve in goroutine 4\n\t/go/net/http/server.go:2 +0x2",
			waiting: true},
		{name: "elided frames", block: "goroutine 11 [select]:\nnet/http.x()\n\t/go/x.go:1 +0x1\n...additional frames elided...\ncreated by " + pkg + ".Run in goroutine 1\n\t/src/x/x.go:5 +0x2",
			created: true, waiting: true},
	} {
		g := parse(c.block)
		if g.id == "" || g.runs != c.runs || g.created != c.created || g.waiting != c.waiting {
			t.Errorf("%s: %+v, want runs %v created %v waiting %v", c.name, g, c.runs, c.created, c.waiting)
		}
	}
}

// A goroutine started and joined after the snapshot passes.
func TestJoined(t *testing.T) {
	before := Take()
	done := make(chan struct{})
	go func() { close(done) }()
	<-done
	Joined(t, before)
}
