package ca

import (
	"bytes"
	"crypto"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"strconv"

	"golang.org/x/crypto/scrypt"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// EncryptedKeyPEMType is the PEM block type of a private key encrypted with
// BETTER_COMPUTE_SECRET.
const EncryptedKeyPEMType = "BETTER-COMPUTE ENCRYPTED PRIVATE KEY"

// Key-derivation parameters. N=2^15, r=8, p=1 costs about 32 MiB and some
// tens of milliseconds per key: a bundle holds five keys, so loading one
// stays well under a second while a guessed secret costs the same.
const (
	scryptLogN    = 15
	scryptR       = 8
	scryptP       = 1
	scryptSaltLen = 16
	// Bounds accepted when decrypting, so an edited key file cannot make
	// Load spend unbounded memory or time.
	scryptMinLogN = 10
	scryptMaxLogN = 20
	scryptMaxR    = 16
	scryptMaxP    = 4
)

// PEM headers of an encrypted key. Their values are bound to the ciphertext
// as AES-GCM additional data, so none can be changed without detection.
const (
	hdrKDF    = "KDF"
	hdrN      = "Scrypt-N"
	hdrR      = "Scrypt-R"
	hdrP      = "Scrypt-P"
	hdrSalt   = "Salt"
	hdrCipher = "Cipher"
	hdrNonce  = "Nonce"
)

// CheckSecret refuses a BETTER_COMPUTE_SECRET too weak to encrypt keys with:
// empty, or estimated below secret.MinStrongBits (128) bits by
// secret.EstimateBits. Every key is encrypted through
// it, so no new key file is made under a weak secret; decrypting does not
// check, so key files made before the rule still open (the server warns).
func CheckSecret(sec []byte) error {
	if len(sec) == 0 {
		return errSecretMissing()
	}
	if bits := secret.EstimateBits(string(sec)); bits < secret.MinStrongBits {
		return errs.New(errs.InvalidConfig, "BETTER_COMPUTE_SECRET is too weak (an estimated %d bits; at least %d are required): generate one with better-compute pki generate-secret",
			int(bits), secret.MinStrongBits)
	}
	return nil
}

// EncryptKey encrypts key (a concrete private key that x509.MarshalPKCS8PrivateKey
// accepts) as PKCS#8 under a key derived from secret with scrypt and a random
// salt, using AES-256-GCM, and returns a PEM block of type
// EncryptedKeyPEMType whose headers carry the KDF parameters, salt and nonce.
// secret is the value of BETTER_COMPUTE_SECRET; it must pass CheckSecret.
func EncryptKey(key crypto.Signer, secret []byte) ([]byte, error) {
	return encryptKey(key, secret, scryptLogN)
}

func encryptKey(key crypto.Signer, secret []byte, logN int) ([]byte, error) {
	return encryptKeyKDF(key, secret, logN, scryptR, scryptP)
}

// encryptKeyKDF encrypts with the given scrypt parameters, which the file
// records: raising them later changes new files only, and DecryptKey reads
// each file's own.
func encryptKeyKDF(key crypto.Signer, secret []byte, logN, r, p int) ([]byte, error) {
	if err := CheckSecret(secret); err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal private key: %w", err)
	}
	salt := make([]byte, scryptSaltLen)
	if _, err := rand.Read(salt); err != nil {
		return nil, fmt.Errorf("read salt: %w", err)
	}
	h := map[string]string{
		hdrKDF:    "scrypt",
		hdrN:      strconv.Itoa(1 << logN),
		hdrR:      strconv.Itoa(r),
		hdrP:      strconv.Itoa(p),
		hdrSalt:   base64.StdEncoding.EncodeToString(salt),
		hdrCipher: "AES-256-GCM",
	}
	aead, err := keyAEAD(secret, salt, 1<<logN, r, p)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("read nonce: %w", err)
	}
	h[hdrNonce] = base64.StdEncoding.EncodeToString(nonce)
	ct := aead.Seal(nil, nonce, der, keyAAD(h))
	return pem.EncodeToMemory(&pem.Block{Type: EncryptedKeyPEMType, Headers: h, Bytes: ct}), nil
}

// DecryptKey reverses EncryptKey. A wrong secret (or a tampered file) is
// errs.InvalidConfig "cannot decrypt the private key: wrong
// BETTER_COMPUTE_SECRET?"; an empty secret is errs.InvalidConfig too.
func DecryptKey(pemData, secret []byte) (crypto.Signer, error) {
	if len(secret) == 0 {
		return nil, errSecretMissing()
	}
	block, rest := pem.Decode(pemData)
	if block == nil || block.Type != EncryptedKeyPEMType || len(bytes.TrimSpace(rest)) != 0 {
		return nil, errs.New(errs.InvalidConfig, "the private key file is not a %s PEM block", EncryptedKeyPEMType)
	}
	h := block.Headers
	if len(h) != 7 || h[hdrKDF] != "scrypt" || h[hdrCipher] != "AES-256-GCM" {
		return nil, errs.New(errs.InvalidConfig, "the private key file has unsupported encryption headers")
	}
	n, errN := strconv.Atoi(h[hdrN])
	r, errR := strconv.Atoi(h[hdrR])
	p, errP := strconv.Atoi(h[hdrP])
	salt, errS := base64.StdEncoding.DecodeString(h[hdrSalt])
	nonce, errNo := base64.StdEncoding.DecodeString(h[hdrNonce])
	if errN != nil || errR != nil || errP != nil || errS != nil || errNo != nil ||
		n < 1<<scryptMinLogN || n > 1<<scryptMaxLogN || n&(n-1) != 0 ||
		r < 1 || r > scryptMaxR || p < 1 || p > scryptMaxP || len(salt) < 8 {
		return nil, errs.New(errs.InvalidConfig, "the private key file has invalid encryption parameters")
	}
	aead, err := keyAEAD(secret, salt, n, r, p)
	if err != nil {
		return nil, err
	}
	if len(nonce) != aead.NonceSize() {
		return nil, errs.New(errs.InvalidConfig, "the private key file has invalid encryption parameters")
	}
	der, err := aead.Open(nil, nonce, block.Bytes, keyAAD(h))
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "cannot decrypt the private key: wrong BETTER_COMPUTE_SECRET?")
	}
	key, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "the decrypted private key is not PKCS#8")
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, errs.New(errs.InvalidConfig, "the decrypted private key %T cannot sign", key)
	}
	return signer, nil
}

func keyAEAD(secret, salt []byte, n, r, p int) (cipher.AEAD, error) {
	k, err := scrypt.Key(secret, salt, n, r, p, 32)
	if err != nil {
		return nil, fmt.Errorf("derive key: %w", err)
	}
	block, err := aes.NewCipher(k)
	if err != nil {
		return nil, fmt.Errorf("make cipher: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("make gcm: %w", err)
	}
	return aead, nil
}

// keyAAD binds the block type and every header except the nonce (which GCM
// binds itself) to the ciphertext, in a fixed order.
func keyAAD(h map[string]string) []byte {
	var b bytes.Buffer
	b.WriteString(EncryptedKeyPEMType)
	for _, k := range []string{hdrKDF, hdrN, hdrR, hdrP, hdrSalt, hdrCipher} {
		b.WriteByte(0)
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(h[k])
	}
	return b.Bytes()
}

func errSecretMissing() error {
	return errs.New(errs.InvalidConfig, "BETTER_COMPUTE_SECRET is not set: set it to the secret that encrypts the PKI private keys")
}
