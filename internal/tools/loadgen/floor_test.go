package loadgen

import (
	"os"
	"strings"
	"testing"
	"time"
)

// The crypto floor runs the product's own join and renewal crypto (any
// failure is an error) and costs some CPU.
func TestMeasureFloor(t *testing.T) {
	f, err := MeasureFloor()
	if err != nil {
		t.Fatal(err)
	}
	if f.JoinMs <= 0 || f.RenewMs <= 0 {
		t.Fatalf("floor %+v: want CPU for both", f)
	}
}

// One summary line per run, the API's CPU as a multiple of the floor.
func TestSummary(t *testing.T) {
	cpu := map[string]float64{"api": 1.2, "gateway": 0.5}
	tests := []struct {
		name string
		r    Result
		want string
	}{
		{"join, reused", Result{JoinsPerSecond: 812.4, P99ms: 41.25, CPUmsPerJoin: cpu, Floor: &Floor{JoinMs: 0.4, RenewMs: 0.3}},
			"summary: join, reused connections: 812/s, p99 41.2 ms, api 1.200 ms (3.0x the floor), gateway 0.500 ms, crypto floor 0.400 ms per join"},
		{"join, new connections, no floor", Result{NewConnections: true, JoinsPerSecond: 400, P99ms: 80, CPUmsPerJoin: cpu},
			"summary: join, a new TLS connection each: 400/s, p99 80.0 ms, api 1.200 ms, gateway 0.500 ms"},
		{"renewal", Result{JoinsPerSecond: 900, Renew: &RenewResult{NewConnections: true, RenewalsPerSecond: 300, P99ms: 90, CPUmsPerRenewal: cpu}, Floor: &Floor{JoinMs: 0.4, RenewMs: 0.3}},
			"summary: renewal, a new TLS connection each: 300/s, p99 90.0 ms, api 1.200 ms (4.0x the floor), gateway 0.500 ms, crypto floor 0.300 ms per renewal"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := tt.r.Summary(); got != tt.want {
				t.Errorf("got  %s\nwant %s", got, tt.want)
			}
			if strings.Contains(tt.r.Summary(), "\n") {
				t.Error("more than one line")
			}
		})
	}
}

// A named set of processes is accounted as the sum of its members: the same
// process twice is twice its CPU (read from /proc, to one tick per read).
func TestCPUTimesSumsASet(t *testing.T) {
	self := os.Getpid()
	for deadline := time.Now().Add(200 * time.Millisecond); time.Now().Before(deadline); {
	} // some CPU of our own, many ticks
	got := cpuTimes(map[string][]int{"self": {self}, "twice": {self, self}, "gone": {self, 1 << 30}})
	after, err := cpuTime(self)
	if err != nil {
		t.Fatal(err)
	}
	const tick = 0.02 // seconds: one clock tick per read, generously
	if got["self"] <= 0 || got["twice"] < 2*got["self"]-tick || got["twice"] > 2*after+tick {
		t.Fatalf("cpuTimes %v, process CPU after %.3f s", got, after)
	}
	if _, ok := got["gone"]; ok {
		t.Fatalf("a set with a missing process got a figure: %v", got)
	}
}
