package errs

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"testing"
)

// A wrapped error keeps its cause for errors.Is and errors.As, and its
// message stays the caller-safe one the format made.
func TestWrapKeepsCause(t *testing.T) {
	cause := fmt.Errorf("open /etc/bcd/config.toml: %w", fs.ErrPermission)
	e := Wrap(cause, InvalidConfig, "cannot read the bcd config: %v", cause)
	if !errors.Is(e, fs.ErrPermission) {
		t.Fatal("the cause is lost")
	}
	if e.Message != "cannot read the bcd config: open /etc/bcd/config.toml: permission denied" || e.Error() != "INVALID_CONFIG: "+e.Message {
		t.Fatalf("message %q, error %q", e.Message, e.Error())
	}
	// The outermost code wins, through any wrapping.
	inner := New(NotFound, "no such node")
	outer := fmt.Errorf("renew: %w", Wrap(inner, Unavailable, "the gateway is down"))
	if CodeOf(outer) != Unavailable || !errors.Is(outer, inner) {
		t.Fatalf("code %s; inner kept %v", CodeOf(outer), errors.Is(outer, inner))
	}
	if got := Wrap(context.Canceled, Unavailable, "stopped"); !errors.Is(got, context.Canceled) || got.Message != "stopped" {
		t.Fatalf("%v", got)
	}
	if New(Internal, "x").Unwrap() != nil {
		t.Fatal("New has a cause")
	}
}
