package loadgen

import (
	"errors"
	"fmt"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
)

// Errors are counted by kind: the same failure on two connections is one
// kind, and past maxErrorKinds new kinds are dropped, known ones counted.
func TestNoteErrorKinds(t *testing.T) {
	h := &holder{errors: map[string]int{}}
	h.noteError(errors.New(`Post "https://127.0.0.1:18690/x": write tcp 127.0.0.1:47356->127.0.0.1:18690: write: broken pipe`))
	h.noteError(errors.New(`Post "https://127.0.0.1:18690/x": write tcp 127.0.0.1:51000->127.0.0.1:18690: write: broken pipe`))
	h.noteError(nil)
	want := `Post "https://127.0.0.1:18690/x": write tcp 127.0.0.1:*->127.0.0.1:18690: write: broken pipe`
	if st := h.status(0); len(st.Errors) != 1 || st.Errors[want] != 2 {
		t.Fatalf("%v", st.Errors)
	}
	for i := range 2 * maxErrorKinds {
		h.noteError(fmt.Errorf("kind %d", i))
	}
	h.noteError(errors.New(want))
	if st := h.status(0); len(st.Errors) != maxErrorKinds || st.Errors[want] != 3 {
		t.Fatalf("%d kinds, %d of the first", len(st.Errors), st.Errors[want])
	}
}

// A killed process counts as released once it is a zombie without
// threads or gone, never while it runs.
func TestReleased(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	if released(pid) {
		t.Fatal("a running process counts as released")
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "the killed process released", func() bool { return released(pid) })
	_ = cmd.Wait()
	if !released(pid) {
		t.Fatal("a reaped process does not count as released")
	}
}
