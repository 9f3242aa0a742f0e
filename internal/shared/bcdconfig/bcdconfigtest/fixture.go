// Package bcdconfigtest builds the minimal bcd config.toml that tests of
// bcd's config (its format in bcdconfig, its pins in node/config) start
// from: the five keys docs/joining.md shows, with fresh pins.
package bcdconfigtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// NewKey returns a fresh P-256 key.
func NewKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// PinOf returns k's SPKI pin.
func PinOf(t testing.TB, k *ecdsa.PrivateKey) string {
	t.Helper()
	p, err := pki.Pin(&k.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Fixture is a site and the three pins a config names; EncKey is the
// private half of the join-encryption pin.
type Fixture struct {
	Site, CAPin, SigPin, EncPin string
	EncKey                      *ecdsa.PrivateKey
}

// New returns a Fixture with fresh keys.
func New(t testing.TB) Fixture {
	t.Helper()
	enc := NewKey(t)
	return Fixture{
		Site:   ids.New(ids.Site, time.Unix(1_700_000_000, 0)),
		CAPin:  PinOf(t, NewKey(t)),
		SigPin: PinOf(t, NewKey(t)),
		EncPin: PinOf(t, enc),
		EncKey: enc,
	}
}

// TOML is the config with the five keys, followed by extra.
func (f Fixture) TOML(extra string) string {
	return `gateway_url = "https://gw.eu.example.com"
site = "` + f.Site + `"
serving_ca_spki_pin = "` + f.CAPin + `"
join_signing_key_pin = "` + f.SigPin + `"
join_encryption_key_pin = "` + f.EncPin + `"
` + extra
}
