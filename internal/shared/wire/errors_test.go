package wire

import (
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// The boundary sends a product error's code and message only: a cause it
// wraps (a path, SQL, a peer's words) stays on the server.
func TestToWireSendsNoCause(t *testing.T) {
	cause := errors.New("pq: relation nodes at /var/lib/secret.db")
	out := ToWire(slog.New(slog.NewTextHandler(io.Discard, nil)), "/x", errs.Wrap(cause, errs.Unavailable, "the store is down"))
	var ce *connect.Error
	if !errors.As(out, &ce) {
		t.Fatalf("%T", out)
	}
	if ce.Code() != connect.CodeUnavailable || ce.Message() != "the store is down" || strings.Contains(out.Error(), "secret") {
		t.Fatalf("code %s message %q (%v)", ce.Code(), ce.Message(), out)
	}
	if errors.Is(out, cause) {
		t.Fatal("the wire error carries the cause")
	}
}

// The detail's type name is on the wire (clients, the TypeScript one too,
// find the detail by it): it stays bettercompute.v1.ErrorDetail, with the
// code in field 1 and the field in field 2, and comes back as the product
// error.
func TestErrorDetailOnTheWire(t *testing.T) {
	out := ToWire(slog.New(slog.NewTextHandler(io.Discard, nil)), "/x", errs.Invalid("name", "too long"))
	var ce *connect.Error
	if !errors.As(out, &ce) || len(ce.Details()) != 1 {
		t.Fatalf("%v: want one detail", out)
	}
	d := ce.Details()[0]
	// Fields 1 and 2, length-delimited: "INVALID_ARGUMENT", "name".
	want := "\x0a\x10INVALID_ARGUMENT\x12\x04name"
	if d.Type() != "bettercompute.v1.ErrorDetail" || string(d.Bytes()) != want {
		t.Fatalf("detail %s %q, want bettercompute.v1.ErrorDetail %q", d.Type(), d.Bytes(), want)
	}
	e, ok := errs.As(FromWire(out))
	if !ok || e.Code != errs.InvalidArgument || e.Field != "name" || e.Message != "name: too long" {
		t.Fatalf("FromWire: %#v", e)
	}
}
