// Package e2e runs the real binaries (better-compute dev, serve, gateway and
// bcd) as separate processes and drives them the way an operator and a
// machine would.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// binaries builds better-compute and bcd once per test binary.
func binaries(t *testing.T) (bc, bcd string) {
	t.Helper()
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "bc-e2e-bin-")
		if buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", binDir+"/", "github.com/better-compute/better-compute/cmd/better-compute", "github.com/better-compute/better-compute/cmd/bcd")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(binDir, "better-compute"), filepath.Join(binDir, "bcd")
}

// freePort returns a loopback address whose port was free a moment ago. It
// is racy (another process may take the port before the one handed it
// binds it), so a listener binds port 0 and its address is read from the
// process's ready line wherever that can be done. It remains where the
// address must be named before its process starts: serve publishing its
// gateway's URL (stackOpts.Advertise), a gateway naming a replica that
// starts later (TestRollingUpgrade), the docs' commands naming dev's
// addresses, and swtpm, which reports no port it bound.
func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// proc is a background process whose output is kept for failure reports.
type proc struct {
	cmd *exec.Cmd
	out *bytes.Buffer
	mu  sync.Mutex
	// done is closed once the process exited; err is then Wait's error.
	done chan struct{}
	err  error
}

func start(t *testing.T, env []string, name string, args ...string) *proc {
	t.Helper()
	p := &proc{out: &bytes.Buffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(name, args...)
	p.cmd.Env = append(os.Environ(), env...)
	pr, pw, _ := os.Pipe()
	p.cmd.Stdout, p.cmd.Stderr = pw, pw
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	read := make(chan struct{})
	go func() {
		defer close(read)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			p.mu.Lock()
			p.out.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
		}
	}()
	// done means exited with its output read to the end: Wait alone can
	// return before the reader has the last lines (a test then missed
	// "joined as" printed just before exit). A descendant still holding
	// the pipe does not hold done for more than a few seconds.
	go func() {
		err := p.cmd.Wait()
		select {
		case <-read:
		case <-time.After(5 * time.Second):
		}
		p.err = err
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
		}
		if t.Failed() {
			t.Logf("output of %s:\n%s", filepath.Base(name), p.output())
		}
	})
	return p
}

// exited waits up to d for the process to exit and returns its exit code.
func (p *proc) exited(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		t.Fatalf("%s did not exit within %s", p.cmd.Path, d)
	}
	if ee, ok := p.err.(*exec.ExitError); ok {
		return ee.ExitCode()
	} else if p.err != nil {
		t.Fatalf("%s: %v", p.cmd.Path, p.err)
	}
	return 0
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.out.String()
}

// waitFor polls until cond holds or the deadline passes.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	// Conditions here run the CLI or read a process's output: every 100 ms.
	if !poll.WaitEvery(d, 100*time.Millisecond, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// run runs a command to completion and returns stdout, stderr and the exit code.
func run(t *testing.T, env []string, stdin string, name string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdin = strings.NewReader(stdin)
	var so, se bytes.Buffer
	cmd.Stdout, cmd.Stderr = &so, &se
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("%s %v: %v", name, args, err)
	}
	return so.String(), se.String(), code
}

// readEnv parses dev.env.
func readEnv(t *testing.T, path string) map[string]string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimPrefix(l, "export ")
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(k, "#") {
			out[k] = v
		}
	}
	return out
}

func envList(m map[string]string) []string {
	var out []string
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	return out
}

// fakeSysfs writes the DMI and NIC files of one machine under dir.
func fakeSysfs(t *testing.T, dir, serial, uuid, mac string) {
	t.Helper()
	dmi := filepath.Join(dir, "class", "dmi", "id")
	must(t, os.MkdirAll(dmi, 0o755))
	for name, v := range map[string]string{"product_uuid": uuid, "product_serial": serial, "board_serial": "BRD-" + serial, "chassis_serial": "CH-" + serial} {
		must(t, os.WriteFile(filepath.Join(dmi, name), []byte(v+"\n"), 0o444))
	}
	nic := filepath.Join(dir, "class", "net", "eth0")
	must(t, os.MkdirAll(filepath.Join(nic, "device"), 0o755))
	must(t, os.WriteFile(filepath.Join(nic, "address"), []byte(mac+"\n"), 0o444))
	must(t, os.WriteFile(filepath.Join(nic, "addr_assign_type"), []byte("0\n"), 0o444))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func jsonOf(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("not JSON: %v\n%s", err, s)
	}
	return m
}
