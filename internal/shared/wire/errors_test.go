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
