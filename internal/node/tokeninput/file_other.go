//go:build !unix

package tokeninput

import (
	"os"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

func osLookupEnv(k string) (string, bool) { return os.LookupEnv(k) }

// FromFile is not supported off Unix: the owner and mode checks it needs
// have no equivalent there.
func FromFile(path string) (token string, cleanup func() (warning string, err error), err error) {
	return "", nil, errs.New(errs.InvalidArgument, "--token-file is supported on Linux only")
}
