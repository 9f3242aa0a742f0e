package ca

import (
	"bytes"
	"encoding/pem"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R3.1: private keys at rest are encrypted with BETTER_COMPUTE_SECRET.
func TestEncryptKeyRoundTrip(t *testing.T) {
	key := newP256(t)
	data, err := EncryptKey(key, testSecret)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	if block == nil || block.Type != EncryptedKeyPEMType {
		t.Fatalf("PEM type = %v", block)
	}
	if block.Headers["KDF"] != "scrypt" || block.Headers["Scrypt-N"] != "32768" || block.Headers["Cipher"] != "AES-256-GCM" {
		t.Errorf("headers = %v", block.Headers)
	}
	got, err := DecryptKey(data, testSecret)
	if err != nil {
		t.Fatal(err)
	}
	if !key.Equal(got) {
		t.Error("decrypted key differs")
	}
}

// R3.1: a wrong or missing secret, or an edited file, is INVALID_CONFIG.
func TestDecryptKeyRefusals(t *testing.T) {
	data, err := encryptKey(newP256(t), testSecret, 10)
	if err != nil {
		t.Fatal(err)
	}
	edited := bytes.Replace(data, []byte("Scrypt-R: 8"), []byte("Scrypt-R: 9"), 1)
	huge := bytes.Replace(data, []byte("Scrypt-N: 1024"), []byte("Scrypt-N: 1073741824"), 1)
	tests := []struct {
		name    string
		data    []byte
		secret  string
		message string
	}{
		{"wrong secret", data, "wrong", "cannot decrypt the private key: wrong BETTER_COMPUTE_SECRET?"},
		{"no secret", data, "", "BETTER_COMPUTE_SECRET is not set: set it to the secret that encrypts the PKI private keys"},
		{"edited header", edited, string(testSecret), "cannot decrypt the private key: wrong BETTER_COMPUTE_SECRET?"},
		{"unbounded cost", huge, string(testSecret), "the private key file has invalid encryption parameters"},
		{"not PEM", []byte("junk"), string(testSecret), "the private key file is not a BETTER-COMPUTE ENCRYPTED PRIVATE KEY PEM block"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := DecryptKey(tt.data, []byte(tt.secret))
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidConfig || e.Message != tt.message {
				t.Errorf("err = %v, want INVALID_CONFIG %q", err, tt.message)
			}
		})
	}
}
