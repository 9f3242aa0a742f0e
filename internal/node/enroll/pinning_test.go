package enroll

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
)

// parseChain parses IssueGateway's PEM (leaf, then serving CA).
func parseChain(t *testing.T, certPEM []byte) []*x509.Certificate {
	t.Helper()
	var out []*x509.Certificate
	for rest := certPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return out
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
}

// R4.3: the gateway is trusted through the serving CA pin and nothing else.
func TestVerifyPinnedChain(t *testing.T) {
	now := time.Now().UTC().Truncate(time.Second)
	b, err := ca.Generate("compute.example.com", now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	other, err := ca.Generate("compute.example.com", now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	pins, _ := b.Pins()
	issue := func(bb *ca.Bundle) []*x509.Certificate {
		certPEM, _, err := ca.IssueGateway(bb, []string{"gw.eu.example.com"}, now, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return parseChain(t, certPEM)
	}
	good := issue(b)
	foreign := issue(other)
	otherPins, _ := other.Pins()
	tests := []struct {
		name   string
		chain  []*x509.Certificate
		server string
		at     time.Time
		pins   []string // nil: pins.ServingCA
		want   string   // empty: accepted
	}{
		{name: "pinned CA", chain: good, server: "gw.eu.example.com", at: now},
		// R16.2: during a rotation the set holds the old and the next CA.
		{name: "any CA of the set", chain: foreign, server: "gw.eu.example.com", at: now, pins: []string{pins.ServingCA, otherPins.ServingCA}},
		{name: "the older CA of the set", chain: good, server: "gw.eu.example.com", at: now, pins: []string{pins.ServingCA, otherPins.ServingCA}},
		{name: "a set without the CA", chain: good, server: "gw.eu.example.com", at: now, pins: []string{otherPins.ServingCA}, want: "does not contain the serving CA"},
		{name: "nothing presented", chain: nil, server: "gw.eu.example.com", at: now, want: "no certificate"},
		{name: "leaf only", chain: good[:1], server: "gw.eu.example.com", at: now, want: "only its own certificate"},
		{name: "another CA", chain: foreign, server: "gw.eu.example.com", at: now, want: "does not contain the serving CA"},
		// A leaf of another CA presented with our (public) CA certificate:
		// the CA is pinned but did not sign the leaf.
		{name: "our CA beside a foreign leaf", chain: []*x509.Certificate{foreign[0], good[1]}, server: "gw.eu.example.com", at: now, want: "does not verify"},
		{name: "another name", chain: good, server: "gw.us.example.com", at: now, want: "does not verify"},
		{name: "expired", chain: good, server: "gw.eu.example.com", at: now.Add(2 * time.Hour), want: "does not verify"},
		{name: "the CA presented as the leaf", chain: []*x509.Certificate{good[1], good[1]}, server: "gw.eu.example.com", at: now, want: "does not verify"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			set := tt.pins
			if set == nil {
				set = []string{pins.ServingCA}
			}
			err := VerifyPinnedChain(tt.chain, set, tt.server, tt.at)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("R4.3: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("R4.3: %v, want %q", err, tt.want)
			}
		})
	}
}

func TestPinnedTLSConfig(t *testing.T) {
	if _, err := PinnedTLSConfig([]string{"sha256/x"}, "gw", nil); err == nil {
		t.Error("accepted a bad pin")
	}
	b, _ := ca.Generate("compute.example.com", time.Now())
	pins, _ := b.Pins()
	if _, err := PinnedTLSConfig([]string{pins.ServingCA}, "", nil); err == nil {
		t.Error("accepted no server name")
	}
	c, err := PinnedTLSConfig([]string{pins.ServingCA}, "gw", nil)
	if err != nil || c.ServerName != "gw" || c.VerifyConnection == nil || c.MinVersion < tls.VersionTLS12 {
		t.Fatalf("R4.3: %+v %v", c, err)
	}
}
