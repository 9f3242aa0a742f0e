package h2upstream

import (
	"encoding/binary"
	"errors"
	"net/http"
	"net/url"
	"strconv"
)

// ErrMessageTooLarge is a stream's end when the server sends a message
// over Config.MaxMessageSize.
var ErrMessageTooLarge = errors.New("h2upstream: gRPC message over the limit")

// messages cuts a stream's DATA into gRPC length-prefixed messages (a
// flags byte, a 4-byte big-endian length, the message). Between calls it
// holds only an unfinished message. It is h2server's Messages, kept here
// until the two packages share one.
type messages struct {
	max  int
	hdr  [5]byte
	nhdr int
	need int
	buf  []byte // the unfinished message, nil when none
}

// feed consumes p and calls emit for each message it completes; msg is
// valid only during the call. window is how many bytes of p the message
// took; held is how many bytes of p an unfinished message holds (to
// return to the server's window at once: they are bounded by max).
func (m *messages) feed(p []byte, emit func(flags byte, msg []byte, window int) error) (held int, err error) {
	for len(p) > 0 {
		start := len(p)
		if m.nhdr < len(m.hdr) {
			n := copy(m.hdr[m.nhdr:], p)
			m.nhdr += n
			p = p[n:]
			if m.nhdr < len(m.hdr) {
				return start - len(p), nil
			}
			size := binary.BigEndian.Uint32(m.hdr[1:])
			if uint64(size) > uint64(m.max) {
				return 0, ErrMessageTooLarge
			}
			m.need = int(size)
		}
		var msg []byte
		switch {
		case m.buf == nil && len(p) >= m.need:
			msg, p = p[:m.need], p[m.need:]
		default:
			if m.buf == nil {
				m.buf = make([]byte, 0, m.need)
			}
			n := min(len(p), m.need-len(m.buf))
			m.buf = append(m.buf, p[:n]...)
			p = p[n:]
			if len(m.buf) < m.need {
				return start - len(p), nil
			}
			msg = m.buf
		}
		flags := m.hdr[0]
		m.nhdr, m.need, m.buf = 0, 0, nil
		if err := emit(flags, msg, start-len(p)); err != nil {
			return 0, err
		}
	}
	return 0, nil
}

// partial reports whether an unfinished message is held.
func (m *messages) partial() bool { return m.nhdr > 0 }

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
