package dnsname

import (
	"strings"
	"testing"
)

func TestValid(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"gw.eu.example.com", true}, {"localhost", true}, {"a-b.c", true},
		{"", false}, {"-a.b", false}, {"a-.b", false}, {"a..b", false}, {"a.b.", false}, {"a_b", false},
		{strings.Repeat("a", 64), false}, {strings.Repeat("a.", 127) + "a", false},
	} {
		if got := Valid(tc.in); got != tc.want {
			t.Errorf("Valid(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}
