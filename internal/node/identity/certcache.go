package identity

import (
	"crypto/sha256"
	"crypto/x509"
	"runtime"
	"sync"
	"weak"
)

// Parsed CA and bundle certificates are shared: every identity loaded in
// a process that names the same CA certificate or command-signing
// certificate (byte for byte) holds one parsed copy of it. bcd holds one
// identity, so this saves it only the copy a reload makes while the
// previous one is still referenced; a process that runs many simulated
// daemons (the load generator's hold mode) saves a parsed copy per daemon.
// Entries are weak: a certificate no identity holds any more is collected,
// and its entry with it.
//
// SECURITY: a parsed *x509.Certificate is never modified after parsing
// (nothing in bcd writes to one), and the key is the SHA-256 of the whole
// DER, so an entry is only ever the parse of exactly those bytes.
var sharedCerts = struct {
	sync.Mutex
	m map[[sha256.Size]byte]weak.Pointer[x509.Certificate]
}{m: map[[sha256.Size]byte]weak.Pointer[x509.Certificate]{}}

// parseShared parses der, or returns the certificate parsed from the same
// bytes that is still in use.
func parseShared(der []byte) (*x509.Certificate, error) {
	key := sha256.Sum256(der)
	sharedCerts.Lock()
	wp, ok := sharedCerts.m[key]
	sharedCerts.Unlock()
	if ok {
		if c := wp.Value(); c != nil {
			return c, nil
		}
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	sharedCerts.Lock()
	defer sharedCerts.Unlock()
	if wp, ok := sharedCerts.m[key]; ok {
		if prev := wp.Value(); prev != nil {
			return prev, nil // parsed meanwhile by another load
		}
	}
	wp = weak.Make(c)
	sharedCerts.m[key] = wp
	runtime.AddCleanup(c, func(key [sha256.Size]byte) {
		sharedCerts.Lock()
		defer sharedCerts.Unlock()
		// Only this certificate's entry: a later parse may own it now.
		if cur, ok := sharedCerts.m[key]; ok && cur == wp {
			delete(sharedCerts.m, key)
		}
	}, key)
	return c, nil
}
