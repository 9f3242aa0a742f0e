// Package tokeninput reads the join token bcd join presents (R11.2): from
// standard input, from BCD_JOIN_TOKEN (the install script), or from
// --token-file (a deploy's user data, a Kubernetes Secret). Never from an
// argument, where every user of the machine could read it in the process
// list.
//
// SECURITY: a token is a bearer credential. No message here ever contains
// the input, even when it is not a token, since a mistyped token is still
// mostly a token.
package tokeninput

import (
	"io"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

const (
	// EnvVar is the environment variable the install script passes the
	// token in.
	EnvVar = "BCD_JOIN_TOKEN"
	// MaxSize bounds what is read from standard input or a token file. A
	// token is about 80 bytes.
	MaxSize = 4 << 10

	scheme   = "bcjt"
	idPrefix = "jt_"
	// maxIDLen matches secret.Parse's bound on the id.
	maxIDLen = 64
)

// shapeHelp says what a token looks like, without any of the input.
const shapeHelp = "want a join token bcjt_jt_….<secret> as join-tokens create printed it"

// Parse trims s and checks that it has the shape of a join token:
// "bcjt_" + an id "jt_…" + "." + 43 characters of base64url (256 bits). It
// returns the trimmed token. It does not check the token with the control
// plane. The error is errs.InvalidArgument and never contains s.
func Parse(s string) (string, error) {
	tok := strings.TrimSpace(s)
	if tok == "" {
		return "", errs.New(errs.InvalidArgument, "the join token is empty; %s", shapeHelp)
	}
	id, _, ok := secret.Parse(scheme, tok)
	if !ok || !validID(id) {
		if strings.HasPrefix(tok, "bck_") {
			return "", errs.New(errs.InvalidArgument, "that is an API key, not a join token; %s", shapeHelp)
		}
		return "", errs.New(errs.InvalidArgument, "not a join token; %s", shapeHelp)
	}
	return tok, nil
}

// validID accepts jt_ followed by lower-case letters and digits (the ids
// package's alphabet is a subset).
func validID(id string) bool {
	rest, ok := strings.CutPrefix(id, idPrefix)
	if !ok || rest == "" || len(id) > maxIDLen {
		return false
	}
	for i := 0; i < len(rest); i++ {
		c := rest[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// FromStdin reads the token from r (standard input), at most MaxSize bytes.
func FromStdin(r io.Reader) (string, error) {
	data, err := io.ReadAll(io.LimitReader(r, MaxSize+1))
	if err != nil {
		return "", errs.Wrap(err, errs.InvalidArgument, "cannot read the join token from standard input: %v", err)
	}
	if len(data) > MaxSize {
		return "", errs.New(errs.InvalidArgument, "standard input holds more than %d bytes; %s", MaxSize, shapeHelp)
	}
	if strings.TrimSpace(string(data)) == "" {
		return "", errs.New(errs.InvalidArgument, "no join token on standard input: pipe it in, as in bcd join < join-token")
	}
	return Parse(string(data))
}

// FromEnv reads the token from BCD_JOIN_TOKEN through lookupEnv (nil means
// os.LookupEnv). ok is false when the variable is unset or empty. The caller
// should unset the variable once it has the token, so child processes do not
// inherit it.
func FromEnv(lookupEnv func(string) (string, bool)) (token string, ok bool, err error) {
	if lookupEnv == nil {
		lookupEnv = osLookupEnv
	}
	v, set := lookupEnv(EnvVar)
	if !set || strings.TrimSpace(v) == "" {
		return "", false, nil
	}
	if len(v) > MaxSize {
		return "", true, errs.New(errs.InvalidArgument, "%s holds more than %d bytes; %s", EnvVar, MaxSize, shapeHelp)
	}
	tok, err := Parse(v)
	if err != nil {
		e, _ := errs.As(err)
		return "", true, errs.New(errs.InvalidArgument, "%s: %s", EnvVar, e.Message)
	}
	return tok, true, nil
}
