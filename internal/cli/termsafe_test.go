package cli

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// escape makes every control character visible.
func TestEscape(t *testing.T) {
	tests := []struct {
		name, in     string
		cell, layout string
	}{
		{"plain", "node-1 ok", "node-1 ok", "node-1 ok"},
		{"unicode text stays", "Grüße 東京 ✓", "Grüße 東京 ✓", "Grüße 東京 ✓"},
		{"retitle (OSC)", "\x1b]0;pwned\x07", `\u001b]0;pwned\u0007`, `\u001b]0;pwned\u0007`},
		{"clear screen (CSI)", "\x1b[2J\x1b[H", `\u001b[2J\u001b[H`, `\u001b[2J\u001b[H`},
		{"C1 CSI", "a\u009b2Jb", `a\u009b2Jb`, `a\u009b2Jb`},
		{"DEL and NUL", "a\x7fb\x00c", `a\u007fb\u0000c`, `a\u007fb\u0000c`},
		{"carriage return", "ok\rFAILED", `ok\rFAILED`, `ok\rFAILED`},
		{"newline and tab", "a\nb\tc", `a\nb\tc`, "a\nb\tc"},
		{"bidi override", "abc\u202edcb", `abc\u202edcb`, `abc\u202edcb`},
		{"line separator", "a\u2028b", `a\u2028b`, `a\u2028b`},
		{"invalid UTF-8 (8-bit CSI)", "a\x9b2J", `a\x9b2J`, `a\x9b2J`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := escape(tt.in, false); got != tt.cell {
				t.Errorf("cell: escape(%q) = %q, want %q", tt.in, got, tt.cell)
			}
			if got := escape(tt.in, true); got != tt.layout {
				t.Errorf("layout: escape(%q) = %q, want %q", tt.in, got, tt.layout)
			}
		})
	}
}

// The writer holds a UTF-8 sequence split across writes, and JSON through
// it stays valid JSON with the same values.
func TestSafeWriter(t *testing.T) {
	var out bytes.Buffer
	w := newSafeWriter(&out)
	for _, p := range [][]byte{[]byte("é"[:1]), []byte("é"[1:] + "\x1b[2J\n"), []byte("\u009b"[:1])} {
		if n, err := w.Write(p); err != nil || n != len(p) {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if got, want := out.String(), "é\\u001b[2J\n\\xc2"; got != want {
		t.Fatalf("wrote %q, want %q", got, want)
	}

	hostile := "x\x1b]0;t\x07\u009b\x7f\u202e\u2028\r\n\ty"
	b, _ := json.MarshalIndent(map[string]string{"error": hostile}, "", "  ")
	out.Reset()
	w = newSafeWriter(&out)
	w.Write(b)
	w.Flush()
	for _, c := range out.String() {
		if c != '\n' && unsafeRune(c) {
			t.Fatalf("JSON output carries %U: %q", c, out.String())
		}
	}
	var back map[string]string
	if err := json.Unmarshal(out.Bytes(), &back); err != nil || back["error"] != hostile {
		t.Fatalf("JSON through the writer: %v, %q", err, back["error"])
	}
	if strings.Contains(out.String(), "\x1b") {
		t.Fatal("ESC reached the output")
	}
}
