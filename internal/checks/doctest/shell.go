package doctest

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
)

// Shell is one bash a walkthrough's commands run in, in order, so what a
// block exports, sources or assigns is there for the next, as in the
// reader's terminal. Each command's output (stdout and stderr together) is
// kept apart; a command ending in & runs in the background and its output
// keeps growing.
type Shell struct {
	dir   string
	state string // where outputs and exit codes are written
	cmd   *exec.Cmd
	in    io.WriteCloser
	n     int
	// Rewrite is applied to each command before it runs (a port the test
	// picked for the one the doc shows, for example).
	Rewrite []Replacement
}

// Result is what one command of a block did.
type Result struct {
	Command    string
	Background bool
	out        string
	// Code is the exit code of a foreground command.
	Code int
}

// Output is what the command printed so far (a background one keeps going).
func (r Result) Output() string {
	b, _ := os.ReadFile(r.out)
	return string(b)
}

// NewShell starts bash in dir with env added to the environment.
func NewShell(dir string, env []string) (*Shell, error) { return NewShellIn(dir, env) }

// NewShellIn is NewShell with bash started through wrap, a command that
// runs the command line it is given (unshare and a script that mounts a
// fresh root, say).
func NewShellIn(dir string, env []string, wrap ...string) (*Shell, error) {
	state, err := os.MkdirTemp("", "doctest-")
	if err != nil {
		return nil, err
	}
	s := &Shell{dir: dir, state: state}
	argv := append(append([]string{}, wrap...), "bash", "--noprofile", "--norc")
	s.cmd = exec.Command(argv[0], argv[1:]...)
	s.cmd.Dir = dir
	s.cmd.Env = append(os.Environ(), env...)
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	log, err := os.Create(filepath.Join(state, "shell.log"))
	if err != nil {
		return nil, err
	}
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if s.in, err = s.cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := s.cmd.Start(); err != nil {
		return nil, err
	}
	return s, nil
}

// Run runs one block's commands; a foreground command may take up to
// timeout. It fails only when the shell itself does.
func (s *Shell) Run(b Block, timeout time.Duration) ([]Result, error) {
	var out []Result
	for _, c := range Commands(b.Text) {
		for _, r := range s.Rewrite {
			c = strings.ReplaceAll(c, r.Old, r.New)
		}
		s.n++
		base := filepath.Join(s.state, strconv.Itoa(s.n))
		r := Result{Command: c, out: base + ".out"}
		c, r.Background = Background(c)
		var script string
		if r.Background {
			script = fmt.Sprintf("{ %s\n} >%q 2>&1 </dev/null &\n", c, r.out)
		} else {
			script = fmt.Sprintf("{ %s\n} >%q 2>&1 </dev/null; echo $? >%q.tmp; mv %q.tmp %q.rc\n", c, r.out, base, base, base)
		}
		if _, err := io.WriteString(s.in, script); err != nil {
			return out, fmt.Errorf("%s: the shell is gone: %v", b.Where(), err)
		}
		if !r.Background {
			var rc []byte
			if !poll.WaitEvery(timeout, 50*time.Millisecond, func() bool {
				var err error
				rc, err = os.ReadFile(base + ".rc")
				return err == nil
			}) {
				return out, fmt.Errorf("%s: %q did not finish within %s; it printed:\n%s", b.Where(), c, timeout, r.Output())
			}
			r.Code, _ = strconv.Atoi(strings.TrimSpace(string(rc)))
		}
		out = append(out, r)
	}
	return out, nil
}

// Combined is the block's output as the doc shows it: the foreground
// commands' output in order, then what the background ones printed.
func Combined(rs []Result) string {
	var fg, bg strings.Builder
	for _, r := range rs {
		if r.Background {
			bg.WriteString(r.Output())
		} else {
			fg.WriteString(r.Output())
		}
	}
	return fg.String() + bg.String()
}

// Close interrupts everything the shell started (its process group), then
// kills what is left after grace.
func (s *Shell) Close(grace time.Duration) {
	_ = s.in.Close()
	pg := -s.cmd.Process.Pid
	_ = syscall.Kill(pg, syscall.SIGINT)
	_ = syscall.Kill(pg, syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	<-done
	// Background children outlive bash: give them grace, then kill the group.
	poll.WaitEvery(grace, 50*time.Millisecond, func() bool { return syscall.Kill(pg, 0) != nil })
	_ = syscall.Kill(pg, syscall.SIGKILL)
	_ = os.RemoveAll(s.state)
}
