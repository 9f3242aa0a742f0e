package config

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func pinOf(t *testing.T, k *ecdsa.PrivateKey) string {
	t.Helper()
	p, err := pki.Pin(&k.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

type fixture struct {
	site, caPin, sigPin, encPin string
	encKey                      *ecdsa.PrivateKey
}

func newFixture(t *testing.T) fixture {
	enc := newKey(t)
	return fixture{
		site:   ids.New(ids.Site, time.Unix(1_700_000_000, 0)),
		caPin:  pinOf(t, newKey(t)),
		sigPin: pinOf(t, newKey(t)),
		encPin: pinOf(t, enc),
		encKey: enc,
	}
}

func (f fixture) toml(extra string) string {
	return `gateway_url = "https://gw.eu.example.com"
site = "` + f.site + `"
serving_ca_spki_pin = "` + f.caPin + `"
join_signing_key_pin = "` + f.sigPin + `"
join_encryption_key_pin = "` + f.encPin + `"
` + extra
}
