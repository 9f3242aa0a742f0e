package secret

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"strings"
	"testing"
)

// BETTER_COMPUTE_SECRET=a was accepted. The estimate
// refuses short, repetitive and sequential passphrases and passes
// generated ones.
func TestEstimateBits(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		strong bool
	}{
		{"empty", "", false},
		{"one character", "a", false},
		{"a word", "s3cret", false},
		{"the CI's old secret", "e2e-secret", false},
		{"a known phrase, too short", "correct horse battery staple", false},
		{"repetition", strings.Repeat("a", 200), false},
		{"alternation", strings.Repeat("ab", 100), false},
		{"a sequence", "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", false},
		{"a repeated random chunk", strings.Repeat("q7#K", 30), false},
		{"invalid UTF-8", "\xff\xfe" + GenerateStrong(), false},
		{"generated", GenerateStrong(), true},
		{"a long diceware-like phrase", "tundra-velvet-9-orbit-Quarry-lantern-7-brisk-Mosaic-fjord-2-ember", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bits := EstimateBits(tt.in)
			if got := bits >= MinStrongBits; got != tt.strong {
				t.Fatalf("EstimateBits(%q) = %.0f, want strong=%v", tt.in, bits, tt.strong)
			}
		})
	}
}

// Generated secrets always pass, and so do 32 random bytes in the
// encodings operators use (openssl rand -hex 32 / -base64 32).
func TestEstimateBitsGenerated(t *testing.T) {
	for range 5000 {
		var b [32]byte
		rand.Read(b[:])
		for _, s := range []string{GenerateStrong(), hex.EncodeToString(b[:]), base64.StdEncoding.EncodeToString(b[:])} {
			if bits := EstimateBits(s); bits < MinStrongBits {
				t.Fatalf("EstimateBits(%q) = %.0f < %d", s, bits, MinStrongBits)
			}
		}
	}
	if s := GenerateStrong(); len(s) != 43 {
		t.Fatalf("GenerateStrong() = %q, want 43 characters", s)
	}
}
