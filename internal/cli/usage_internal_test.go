package cli

import (
	"testing"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R3.6: an API field error names the flag the person typed.
func TestAsFlag(t *testing.T) {
	cmd := &cobra.Command{Use: "create"}
	cmd.Flags().String("expect-mac", "", "")
	cmd.Flags().Int("ttl-seconds", 0, "")
	cases := []struct {
		err  error
		want string
	}{
		{errs.Invalid("expect.mac", "must be a MAC"), "INVALID_ARGUMENT: --expect-mac: must be a MAC"},
		{errs.Invalid("ttlSeconds", "too long"), "INVALID_ARGUMENT: --ttl-seconds: too long"},
		{errs.Invalid("tokenId", "not an id"), "INVALID_ARGUMENT: tokenId: not an id"},
		{errs.New(errs.NotFound, "pool not found"), "NOT_FOUND: pool not found"},
	}
	for _, c := range cases {
		if got := asFlag(cmd, c.err).Error(); got != c.want {
			t.Errorf("%v: got %q, want %q", c.err, got, c.want)
		}
	}
}
