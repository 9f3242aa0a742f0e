package ca

import (
	"bytes"
	"crypto"
	"encoding/pem"
	"strconv"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// testSecret is a generated secret (secret.GenerateStrong's form).
var testSecret = []byte("lH3f2xq0m1U8cYt7bVQ2r9nK5sJwE6aZpD4gL0oTyXc")

// a weak BETTER_COMPUTE_SECRET encrypts nothing; a
// generated one does.
func TestCheckSecret(t *testing.T) {
	tests := []struct {
		name, secret, msg string
	}{
		{"empty", "", "BETTER_COMPUTE_SECRET is not set: set it to the secret that encrypts the PKI private keys"},
		{"one character", "a", "BETTER_COMPUTE_SECRET is too weak (an estimated 0 bits; at least 128 are required): generate one with better-compute pki generate-secret"},
		{"a word", "s3cret", "BETTER_COMPUTE_SECRET is too weak (an estimated 15 bits; at least 128 are required): generate one with better-compute pki generate-secret"},
		{"generated", secret.GenerateStrong(), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for name, err := range map[string]error{
				"CheckSecret": CheckSecret([]byte(tt.secret)),
				"EncryptKey": func() error {
					_, err := EncryptKey(newP256(t), []byte(tt.secret))
					return err
				}(),
			} {
				if tt.msg == "" {
					if err != nil {
						t.Fatalf("%s: %v", name, err)
					}
					continue
				}
				e, ok := errs.As(err)
				if !ok || e.Code != errs.InvalidConfig || e.Message != tt.msg {
					t.Fatalf("%s: err = %v, want INVALID_CONFIG %q", name, err, tt.msg)
				}
			}
		})
	}
}

// every key file records its KDF parameters (scrypt N, r,
// p and salt) beside the ciphertext, bound to it as AES-GCM additional
// data, so the parameters can be raised for new keys while older files,
// with the parameters they were written with, still open.
func TestKeyFileRecordsKDFParameters(t *testing.T) {
	key := newP256(t)
	data, err := EncryptKey(key, testSecret)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	for h, want := range map[string]string{"KDF": "scrypt", "Scrypt-N": strconv.Itoa(1 << scryptLogN), "Scrypt-R": strconv.Itoa(scryptR), "Scrypt-P": strconv.Itoa(scryptP)} {
		if block.Headers[h] != want {
			t.Errorf("header %s = %q, want %q", h, block.Headers[h], want)
		}
	}
	if len(block.Headers["Salt"]) == 0 {
		t.Error("no salt recorded")
	}

	// A file written with other parameters (cheaper here, as an older
	// release's would be, or dearer, as a later one's) opens with the
	// parameters it records, not today's constants.
	for _, p := range []struct{ logN, r, p int }{{10, 8, 1}, {11, 4, 2}, {12, 16, 1}} {
		old := encryptWith(t, key, p.logN, p.r, p.p)
		got, err := DecryptKey(old, testSecret)
		if err != nil || !key.Equal(got) {
			t.Fatalf("N=2^%d r=%d p=%d: %v", p.logN, p.r, p.p, err)
		}
		// Editing a recorded parameter is detected (it is authenticated).
		edited := bytes.Replace(old, []byte("Scrypt-R: "+strconv.Itoa(p.r)), []byte("Scrypt-R: "+strconv.Itoa(p.r+1)), 1)
		if _, err := DecryptKey(edited, testSecret); errs.CodeOf(err) != errs.InvalidConfig {
			t.Fatalf("edited r: %v", err)
		}
	}
}

// encryptWith writes key as EncryptKey does, with the given scrypt
// parameters.
func encryptWith(t *testing.T, key crypto.Signer, logN, r, p int) []byte {
	t.Helper()
	data, err := encryptKeyKDF(key, testSecret, logN, r, p)
	if err != nil {
		t.Fatal(err)
	}
	return data
}
