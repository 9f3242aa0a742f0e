package manifest

import (
	"strings"
	"testing"
)

// R18.3: the tests that hold the manifests to the product read their
// embedded files exactly (indentation removed, the block's end found).
func TestLiteral(t *testing.T) {
	doc := "data:\n  a.toml: |\n    x = 1\n\n    [s]\n    y = 2\n  b: \"z\"\nargs:\n  - |\n    set -eu\n    exec bcd run\n"
	for _, tc := range []struct{ header, want string }{
		{"a.toml: |", "x = 1\n\n[s]\ny = 2\n"},
		{"- |", "set -eu\nexec bcd run\n\n"},
	} {
		got, err := Literal(doc, tc.header)
		if err != nil || got != tc.want {
			t.Errorf("Literal(%q) = %q, %v; want %q", tc.header, got, err, tc.want)
		}
	}
	if _, err := Block(doc, "c.toml"); err == nil || !strings.Contains(err.Error(), "c.toml") {
		t.Errorf("a missing block: %v", err)
	}
	if got, err := ConfigMapFile("serve.toml", "control-plane", "configmap.yaml"); err != nil || !strings.Contains(got, "[store]") {
		t.Errorf("ConfigMapFile: %v %q", err, got)
	}
}
