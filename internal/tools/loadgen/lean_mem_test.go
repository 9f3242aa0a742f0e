package loadgen_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/tools/loadgen"
)

// leanMemTarget is what the control plane process of TestLeanMemory
// tells it.
type leanMemTarget struct {
	Config string `json:"config"`
	Token  string `json:"token"`
}

// TestLeanMemoryTarget is the control plane of TestLeanMemory (the API
// and a gateway), in a process of its own so that the load generator's
// memory is measured alone. It serves until its standard input closes.
func TestLeanMemoryTarget(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("BC_LEAN_MEM_TARGET"))
	if n <= 0 {
		t.Skip("the control plane process of TestLeanMemory")
	}
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{HeartbeatMAC: true})
	tg := newTarget(t, e, int32(n+10))
	if err := json.NewEncoder(os.Stdout).Encode(leanMemTarget{Config: tg.configPath, Token: tg.token}); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// leanMem is the process's memory after a collection.
type leanMem struct {
	heap, stacks, rss uint64
	goroutines        int
}

func leanMemNow(t *testing.T) leanMem {
	t.Helper()
	runtime.GC()
	debug.FreeOSMemory()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	s := leanMem{heap: m.HeapInuse, stacks: m.StackInuse, goroutines: runtime.NumGoroutine()}
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			s.rss = kb << 10
		}
	}
	return s
}

// What a lean daemon holding its session costs the load generator: N
// daemons (300; BC_LEAN_MEM=N for more) join a control plane in another
// process and hold their sessions; the heap and stacks in use (and the
// RSS) grown per daemon are reported, and must stay under 48 KiB: 100,000
// of them fit a quarter of this machine kind's memory with room to spare.
// bcd's own loop costs about 240 KiB each (scripts/bench-fleet).
func TestLeanMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("a measurement (and -short runs under the race detector, which multiplies the memory)")
	}
	n := 300
	if v, _ := strconv.Atoi(os.Getenv("BC_LEAN_MEM")); v > 0 {
		n = v
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLeanMemoryTarget$", "-test.timeout=0")
	cmd.Env = append(os.Environ(), "BC_LEAN_MEM_TARGET="+strconv.Itoa(n))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("control plane process: %v\n%s", err, stderr.String())
		}
	}()
	var tg leanMemTarget
	sc := bufio.NewScanner(stdout)
	for tg.Config == "" && sc.Scan() {
		_ = json.Unmarshal(sc.Bytes(), &tg)
	}
	if tg.Config == "" {
		t.Fatalf("the control plane process did not start: %v\n%s", sc.Err(), stderr.String())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()

	base := leanMemNow(t)
	start := time.Now()
	h := startHold(t, loadgen.Config{BCDConfig: tg.Config, Token: tg.Token, Machines: n, Concurrency: 8, Seed: t.Name()},
		loadgen.HoldOptions{Lean: true, StartRate: 500})
	var st loadgen.HoldStatus
	poll.UntilDetail(t, 10*time.Minute, func() string { return fmt.Sprintf("%d sessions up: %+v", n, st) }, func() bool {
		st, _ = h.status(time.Time{})
		return st.Up == n
	})
	up := time.Since(start)
	at := leanMemNow(t)
	if p := os.Getenv("BC_LEAN_MEM_PROFILE"); p != "" {
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := pprof.WriteHeapProfile(f); err != nil {
			t.Fatal(err)
		}
		f.Close()
		t.Logf("heap profile: %s", p)
	}
	per := func(b, a uint64) float64 { return (float64(a) - float64(b)) / 1024 / float64(n) }
	heap, stacks, rss := per(base.heap, at.heap), per(base.stacks, at.stacks), per(base.rss, at.rss)
	t.Logf("%d lean daemons joined and up in %s", n, up.Round(time.Second))
	t.Logf("per held lean daemon: heap in use %.1f KiB, stacks %.1f KiB (together %.1f KiB), RSS %.1f KiB, %.2f goroutines",
		heap, stacks, heap+stacks, rss, float64(at.goroutines-base.goroutines)/float64(n))
	if heap+stacks > 48 {
		t.Errorf("a lean daemon holds %.1f KiB of heap and stacks, over 48 KiB", heap+stacks)
	}
	if n >= 1000 && rss > 48 {
		t.Errorf("a lean daemon grows the RSS by %.1f KiB, over 48 KiB", rss)
	}
	h.stop()
}
