package loadgen

import (
	"errors"
	"fmt"
	"testing"
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
