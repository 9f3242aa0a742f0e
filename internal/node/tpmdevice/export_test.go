package tpmdevice

import "github.com/google/go-tpm/tpm2"

// CreateLegacyKey makes a key from tmpl under the SRK node keys had before
// SRKTemplate, as an older bcd did.
func CreateLegacyKey(t *TPM, tmpl tpm2.TPMTPublic) (*Key, error) {
	return t.createKeyUnder(legacySRKTemplate, tmpl)
}
