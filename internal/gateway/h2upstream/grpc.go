package h2upstream

import (
	"net/http"
	"net/url"
	"strconv"

	"github.com/better-compute/better-compute/internal/gateway/grpcmsg"
)

// ErrMessageTooLarge is a stream's end when the server sends a message
// over Config.MaxMessageSize.
var ErrMessageTooLarge = grpcmsg.ErrTooLarge

// gRPC status codes this package produces itself.
const (
	CodeUnknown       = 2
	CodePermission    = 7
	CodeUnimplemented = 12
	CodeInternal      = 13
	CodeUnavailable   = 14
	CodeUnauthentic   = 16
)

// Status is a stream's gRPC end: its grpc-status, grpc-message
// (percent-decoded) and the trailers.
type Status struct {
	Code    int
	Message string
	Trailer http.Header
}

// statusOf reads a stream's end from its trailers (or the headers of a
// trailers-only answer). A missing grpc-status is Internal.
func statusOf(h http.Header) Status {
	st := Status{Code: CodeInternal, Message: "h2upstream: no grpc-status in the trailers", Trailer: h}
	v := h.Get("Grpc-Status")
	if v == "" {
		return st
	}
	code, err := strconv.Atoi(v)
	if err != nil || code < 0 {
		st.Message = "h2upstream: bad grpc-status " + strconv.Quote(v)
		return st
	}
	st.Code = code
	st.Message = h.Get("Grpc-Message")
	if m, err := url.PathUnescape(st.Message); err == nil {
		st.Message = m
	}
	return st
}

// httpStatus maps a non-200 :status to a gRPC code, as gRPC's "HTTP to
// gRPC status code mapping" does.
func httpStatus(code int) Status {
	c := CodeUnknown
	switch code {
	case 400:
		c = CodeInternal
	case 401:
		c = CodeUnauthentic
	case 403:
		c = CodePermission
	case 404:
		c = CodeUnimplemented
	case 429, 502, 503, 504:
		c = CodeUnavailable
	}
	return Status{Code: c, Message: "h2upstream: HTTP status " + strconv.Itoa(code)}
}
