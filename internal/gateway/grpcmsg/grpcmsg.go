// Package grpcmsg cuts gRPC's length-prefixed messages out of a stream's
// DATA and writes them, for the gateway's HTTP/2 server (h2server) and its
// upstream client (h2upstream): both relay messages without a goroutine
// per stream, so neither can use a blocking reader.
package grpcmsg

import (
	"encoding/binary"
	"errors"
)

// ErrTooLarge is Messages.Feed's answer to a message over Max.
var ErrTooLarge = errors.New("gRPC message over the limit")

// Messages cuts a gRPC stream's DATA into its length-prefixed messages (a
// flags byte, a 4-byte big-endian length, the message), for
// a stream handler that relays or inspects them without a goroutine. Between
// calls it holds only an unfinished message (nothing between messages).
type Messages struct {
	// Max bounds one message's length (max_body_bytes).
	Max int

	hdr  [5]byte
	nhdr int
	need int
	buf  []byte // the unfinished message, nil when none
}

// Feed consumes p and calls emit for each message it completes; msg is
// valid only during the call. It stops at emit's first error.
//
// Flow control: window is how many bytes of p the message took (its
// earlier bytes were held in earlier calls), to return to the client's
// window once the message has been passed on; held is how many bytes of
// p an unfinished message now holds, to return at once (they are bounded
// by Max, and the message cannot finish without more window). Every byte
// of p is in exactly one of them.
func (m *Messages) Feed(p []byte, emit func(flags byte, msg []byte, window int) error) (held int, err error) {
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
			if uint64(size) > uint64(m.Max) {
				return 0, ErrTooLarge
			}
			m.need = int(size)
		}
		var msg []byte
		switch {
		case m.buf == nil && len(p) >= m.need:
			msg, p = p[:m.need], p[m.need:] // whole in p: no copy
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

// Partial reports whether an unfinished message is held.
func (m *Messages) Partial() bool { return m.nhdr > 0 }

// Append appends msg as one length-prefixed gRPC message.
func Append(dst []byte, flags byte, msg []byte) []byte {
	dst = append(dst, flags)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(msg)))
	return append(dst, msg...)
}
