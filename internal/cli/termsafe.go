package cli

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"
)

// Terminal safety. Much of what the CLI prints is text a
// node controls: a command's error and output, hostnames, claims, event
// data. A terminal acts on control characters: ESC sequences retitle the
// window, clear the screen, move the cursor or rewrite what was printed;
// a carriage return overwrites a line; bidi overrides reorder it. So
// nothing the CLI prints reaches the terminal raw: every character that
// is not printable text goes out as a visible escape, made by one
// function, escape.
//
//   - Table cells (table) escape everything, tabs and newlines too, so a
//     value can neither break the columns nor forge rows.
//   - Everything else (plain text, help, errors, logs, JSON) passes
//     through safeWriter, which Main puts in front of stdout and stderr and
//     which keeps only newlines and tabs for layout.
//
// JSON output stays valid JSON with the same values: the JSON encoders
// already escape C0 controls, and what they leave raw inside strings (DEL,
// C1 controls, bidi and line-separator characters) is written as a \uXXXX
// escape, which means the same character to a JSON reader. Invalid UTF-8
// is written as \xNN; the JSON encoders never produce it.

// escape returns s with every unsafe character replaced by a visible
// escape: \n, \t and \r for those (newlines and tabs are kept as they are
// when layout is set), \uXXXX for other control characters (C0, DEL, C1),
// bidi formatting and line/paragraph separators, and \xNN for bytes that
// are not UTF-8.
func escape(s string, layout bool) string {
	if isSafe(s, layout) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case layout && (r == '\n' || r == '\t'):
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\r':
			b.WriteString(`\r`)
		case unsafeRune(r):
			fmt.Fprintf(&b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

func isSafe(s string, layout bool) bool {
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 || unsafeRune(r) && !(layout && (r == '\n' || r == '\t')) {
			return false
		}
		i += size
	}
	return true
}

// unsafeRune reports characters a terminal acts on or that change how the
// text around them reads.
func unsafeRune(r rune) bool {
	switch {
	case unicode.IsControl(r): // C0, DEL, C1 (U+009B is a one-character CSI)
		return true
	case r == 0x2028 || r == 0x2029: // line and paragraph separators
		return true
	case r == 0x061c || r == 0x200e || r == 0x200f, // bidi marks
		r >= 0x202a && r <= 0x202e, // bidi embeddings and overrides
		r >= 0x2066 && r <= 0x2069: // bidi isolates
		return true
	}
	return false
}

// safeWriter escapes what is written to w (layout kept). A UTF-8 sequence
// split across two writes is held until it completes, so it is neither
// escaped as invalid nor let through in pieces; Flush writes what is held.
// It is safe for concurrent use (serve and dev log from many goroutines).
type safeWriter struct {
	mu      sync.Mutex
	w       io.Writer
	pending []byte
}

func newSafeWriter(w io.Writer) *safeWriter { return &safeWriter{w: w} }

func (s *safeWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	buf := append(s.pending, p...)
	cut := len(buf)
	// Hold back an incomplete sequence at the end (at most 3 bytes).
	for i := len(buf) - 1; i >= 0 && i >= len(buf)-utf8.UTFMax+1; i-- {
		if utf8.RuneStart(buf[i]) {
			if !utf8.FullRune(buf[i:]) {
				cut = i
			}
			break
		}
	}
	out := escape(string(buf[:cut]), true)
	s.pending = append([]byte(nil), buf[cut:]...)
	if _, err := io.WriteString(s.w, out); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Flush writes a held incomplete sequence, escaped as the invalid bytes it
// is.
func (s *safeWriter) Flush() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pending) == 0 {
		return nil
	}
	out := escape(string(s.pending), true)
	s.pending = nil
	_, err := io.WriteString(s.w, out)
	return err
}
