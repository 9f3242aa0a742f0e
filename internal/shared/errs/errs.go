// Package errs defines the product's error codes and the error type that
// carries one.
//
// Domain packages return *errs.E (or wrap one with fmt.Errorf("...: %w")).
// One function turns them into wire errors, wire.ToWire (its variant
// ToWireContext), and it never sends anything but the code, the message and
// the offending field. Unary calls reach it through wire.Interceptor, which
// the API installs on the operator and agent handlers, so their handlers
// just return errors. What no handler's interceptor sees calls it itself
// where it ends a call: the session streams (SessionService.Connect in
// internal/controlplane/session, the gateway's session relay), the
// gateway's own refusals (busy, upstream unavailable), and the API's
// authentication, which refuses an operator call before its handler runs.
// Any error that is not an *errs.E reaches the caller as INTERNAL with a
// generic message, so internal detail (SQL, file paths) never leaks.
package errs

import (
	"errors"
	"fmt"
)

// Code is one of the product's error codes. They are part of the API:
// clients and the CLI show them as they are.
type Code string

// The product's error codes.
const (
	NotFound         Code = "NOT_FOUND"
	InvalidState     Code = "INVALID_STATE"
	Conflict         Code = "CONFLICT"
	AlreadyExists    Code = "ALREADY_EXISTS"
	AccessDenied     Code = "ACCESS_DENIED"
	InvalidConfig    Code = "INVALID_CONFIG"
	InvalidArgument  Code = "INVALID_ARGUMENT"
	Unauthenticated  Code = "UNAUTHENTICATED"
	ResourcesLimited Code = "RESOURCE_EXHAUSTED"
	Unavailable      Code = "UNAVAILABLE"
	Internal         Code = "INTERNAL"
)

// E is an error with a product code. Message is safe to show to the caller;
// Field names the offending request field for INVALID_ARGUMENT.
type E struct {
	Code    Code
	Message string
	Field   string
	// Cause is the error this one reports, kept for errors.Is and
	// errors.As and for the server's own logs; it never reaches the
	// caller (the wire sends only Code, Message and Field).
	Cause error
}

func (e *E) Error() string { return string(e.Code) + ": " + e.Message }

// Unwrap returns the cause.
func (e *E) Unwrap() error { return e.Cause }

// Wrap returns an error with code c and a caller-safe message that keeps
// cause as its cause. The message is the format's alone: to show the cause
// to the caller, format it in as before.
func Wrap(cause error, c Code, format string, args ...any) *E {
	return &E{Code: c, Message: fmt.Sprintf(format, args...), Cause: cause}
}

// New returns an error with code c and a caller-safe message.
func New(c Code, format string, args ...any) *E {
	return &E{Code: c, Message: fmt.Sprintf(format, args...)}
}

// Invalid returns INVALID_ARGUMENT naming field.
func Invalid(field, format string, args ...any) *E {
	return &E{Code: InvalidArgument, Field: field, Message: field + ": " + fmt.Sprintf(format, args...)}
}

// CodeOf returns the product code of err, or INTERNAL when err carries none.
func CodeOf(err error) Code {
	var e *E
	if errors.As(err, &e) {
		return e.Code
	}
	return Internal
}

// Is reports whether err carries code c.
func Is(err error, c Code) bool { return err != nil && CodeOf(err) == c }

// As returns the *E inside err, if any.
func As(err error) (*E, bool) {
	var e *E
	ok := errors.As(err, &e)
	return e, ok
}

// MessageOf is the caller-safe message of a product error, or err's text
// when it carries none: for a message that names an inner error.
func MessageOf(err error) string {
	if e, ok := As(err); ok {
		return e.Message
	}
	return err.Error()
}
