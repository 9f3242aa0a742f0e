// Package wire is the one mapping between product errors (*errs.E) and wire
// errors (Connect codes plus an ErrorDetail with the product code): every
// process that answers an RPC calls ToWire, directly or through
// Interceptor, and every client reads errors back with FromWire. It also
// defines the public documents both ends read (the well-known document).
// It depends on nothing of the server, so bcd, the gateway and the
// CLI client use it without pulling in the database.
package wire

import (
	"context"
	"errors"
	"log/slog"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/v1/errordetail"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// wireCodes maps product codes to Connect codes. The product code itself
// travels in an ErrorDetail so clients can show exactly the product's codes.
var wireCodes = map[errs.Code]connect.Code{
	errs.NotFound:         connect.CodeNotFound,
	errs.InvalidState:     connect.CodeFailedPrecondition,
	errs.Conflict:         connect.CodeAborted,
	errs.AlreadyExists:    connect.CodeAlreadyExists,
	errs.AccessDenied:     connect.CodePermissionDenied,
	errs.InvalidConfig:    connect.CodeFailedPrecondition,
	errs.InvalidArgument:  connect.CodeInvalidArgument,
	errs.Unauthenticated:  connect.CodeUnauthenticated,
	errs.ResourcesLimited: connect.CodeResourceExhausted,
	errs.Unavailable:      connect.CodeUnavailable,
	errs.Internal:         connect.CodeInternal,
}

// productCodes maps Connect's own errors (bad JSON, unknown fields, oversized
// bodies, deadlines) to product codes.
var productCodes = map[connect.Code]errs.Code{
	connect.CodeInvalidArgument:    errs.InvalidArgument,
	connect.CodeResourceExhausted:  errs.ResourcesLimited,
	connect.CodeDeadlineExceeded:   errs.Unavailable,
	connect.CodeCanceled:           errs.Unavailable,
	connect.CodeUnauthenticated:    errs.Unauthenticated,
	connect.CodeNotFound:           errs.NotFound,
	connect.CodeUnimplemented:      errs.NotFound,
	connect.CodeUnavailable:        errs.Unavailable,
	connect.CodePermissionDenied:   errs.AccessDenied,
	connect.CodeAlreadyExists:      errs.AlreadyExists,
	connect.CodeAborted:            errs.Conflict,
	connect.CodeFailedPrecondition: errs.InvalidState,
}

// ToWire is the one function that turns a domain error into a wire error:
// Interceptor calls it for unary handlers; the session streams, the
// gateway's own refusals and the API's authentication call it where they
// end a call. Only the product code, the caller-safe message and the field leave
// the process; anything else is logged and answered as INTERNAL.
func ToWire(log *slog.Logger, procedure string, err error) error {
	return ToWireContext(context.Background(), log, procedure, err)
}

// ToWireContext is ToWire logging with the request's context, so the line
// carries what the log handler takes from it (a traced call's trace id).
func ToWireContext(ctx context.Context, log *slog.Logger, procedure string, err error) error {
	if err == nil {
		return nil
	}
	if e, ok := errs.As(err); ok {
		ce := connect.NewError(wireCodes[e.Code], errors.New(e.Message))
		if d, derr := connect.NewErrorDetail(&errordetail.ErrorDetail{Code: string(e.Code), Field: e.Field}); derr == nil {
			ce.AddDetail(d)
		}
		return ce
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		code := productCodes[ce.Code()]
		if code == "" {
			code = errs.Internal
		}
		out := connect.NewError(ce.Code(), errors.New(ce.Message()))
		if d, derr := connect.NewErrorDetail(&errordetail.ErrorDetail{Code: string(code)}); derr == nil {
			out.AddDetail(d)
		}
		return out
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return ToWire(log, procedure, errs.New(errs.Unavailable, "the request was cancelled or timed out"))
	}
	log.ErrorContext(ctx, "internal error", "procedure", procedure, "err", err)
	return ToWire(log, procedure, errs.New(errs.Internal, "internal error"))
}

// FromWire recovers the product error from a wire error (used by clients).
func FromWire(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return errs.New(errs.Unavailable, "%v", err)
	}
	for _, d := range ce.Details() {
		v, derr := d.Value()
		if derr != nil {
			continue
		}
		if ed, ok := v.(*errordetail.ErrorDetail); ok {
			return &errs.E{Code: errs.Code(ed.Code), Message: ce.Message(), Field: ed.Field}
		}
	}
	code := productCodes[ce.Code()]
	if code == "" {
		code = errs.Unavailable
	}
	msg := ce.Message()
	if msg == "" {
		msg = ce.Code().String()
	}
	return &errs.E{Code: code, Message: msg}
}

// Interceptor maps every error of a unary handler through ToWire; streams
// call ToWire themselves.
func Interceptor(log *slog.Logger) connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			res, err := next(ctx, req)
			if err != nil {
				return nil, ToWireContext(ctx, log, req.Spec().Procedure, err)
			}
			return res, nil
		}
	}
}
