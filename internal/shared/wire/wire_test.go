package wire

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
)

// R7.5: exact kinds or prefix.*; an empty list allows every kind.
func TestKindAllowed(t *testing.T) {
	for _, tc := range []struct {
		allowed []string
		kind    string
		want    bool
	}{
		{nil, "node.facts", true},
		{[]string{"node.facts"}, "node.facts", true},
		{[]string{"node.facts"}, "acceptance.check", false},
		{[]string{"node.*"}, "node.facts", true},
		{[]string{"node.*"}, "nodex.facts", false},
		{[]string{"node.*"}, "node", false},
	} {
		if got := KindAllowed(tc.allowed, tc.kind); got != tc.want {
			t.Errorf("KindAllowed(%v, %q) = %v", tc.allowed, tc.kind, got)
		}
	}
}

func TestPeerCertificate(t *testing.T) {
	h := http.Header{}
	SetPeerCertificate(h, []byte{1, 2, 3})
	if got := PeerCertificate(h); !bytes.Equal(got, []byte{1, 2, 3}) {
		t.Fatalf("round trip: %v", got)
	}
	for name, h := range map[string]http.Header{
		"none":      {},
		"two":       {PeerCertificateHeader: {"AQ==", "Ag=="}},
		"not b64":   {PeerCertificateHeader: {"***"}},
		"oversized": {PeerCertificateHeader: {strings.Repeat("A", 20<<10)}},
	} {
		if got := PeerCertificate(h); got != nil {
			t.Errorf("%s: %v", name, got)
		}
	}
}
