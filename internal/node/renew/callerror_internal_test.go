package renew

import (
	"errors"
	"testing"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R13.1: Loop gives up only on what bcd itself found (an expired
// certificate, a TPM it cannot use); an answer relayed by the gateway
// never stops the renewals of a valid certificate, whatever its code.
func TestCallErrorNeverInvalidState(t *testing.T) {
	for _, c := range []struct {
		code connect.Code
		want errs.Code
	}{
		{connect.CodeFailedPrecondition, errs.Unavailable},
		{connect.CodeUnavailable, errs.Unavailable},
		{connect.CodePermissionDenied, errs.AccessDenied},
	} {
		err := callError(connect.NewError(c.code, errors.New("answered")), "gw.example.com:443")
		if e, ok := errs.As(err); !ok || e.Code != c.want {
			t.Errorf("%s: %v, want %s", c.code, err, c.want)
		}
	}
}
