// Package errstest checks product errors in tests: the code and the
// caller-safe message an *errs.E carries. Tests of any process may import
// it; product code never does.
package errstest

import (
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Want fails t unless err is an *errs.E (or wraps one) with code and,
// when msg is not "", exactly that message.
func Want(t testing.TB, err error, code errs.Code, msg string) {
	t.Helper()
	if err == nil {
		t.Fatalf("want %s %q, got success", code, msg)
	}
	e, ok := errs.As(err)
	if !ok {
		t.Fatalf("want %s %q, got %T: %v", code, msg, err, err)
	}
	if e.Code != code || (msg != "" && e.Message != msg) {
		t.Fatalf("want %s %q, got %s %q", code, msg, e.Code, e.Message)
	}
}

// Must fails t when err is not nil.
func Must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
