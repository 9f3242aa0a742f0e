package ca

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/ecdh"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
)

// The decryption half of the seal format (RFC 7516 compact JWE, RFC 7518
// ECDH-ES+A256KW and A256GCM), written here rather than taken from go-jose:
// go-jose's ECDH goes through crypto/elliptic's big.Int ScalarMult and it
// parses the header a second time, together about a tenth of the API's CPU
// per join. Seal stays on go-jose (bcd's side), so the tests seal with
// go-jose and open with this: an interoperability check on every run.
//
// Only what a seal may be is implemented: one recipient, P-256, no apu or
// apv (the header check refuses them), a 256-bit wrapped key.

const (
	sealKeyAlg    = "ECDH-ES+A256KW"
	sealCEKSize   = 32              // A256GCM
	sealWrapped   = sealCEKSize + 8 // AES Key Wrap adds one 64-bit block
	sealIVSize    = 12              // RFC 7518 §5.3
	sealTagSize   = 16              // RFC 7518 §5.3
	sealCoordSize = 32              // P-256
	sealPointSize = 1 + 2*sealCoordSize
)

// decodeSealPart decodes one base64url part of a compact JWE. It is
// stricter than base64.RawURLEncoding.DecodeString, which skips CR and LF
// and takes non-zero trailing bits: a part has one encoding.
func decodeSealPart(s string) ([]byte, error) {
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	if err != nil {
		return nil, err
	}
	if base64.RawURLEncoding.EncodedLen(len(b)) != len(s) {
		return nil, errors.New("not canonical base64url")
	}
	return b, nil
}

// parseSealEPK parses the protected header's epk (RFC 7518 §4.6.1.1): a JWK
// with exactly kty "EC", crv "P-256", x and y (32 bytes each, base64url),
// a point on the curve. Members are looked up by exact name (a map, not a
// struct: encoding/json matches struct fields case-insensitively).
func parseSealEPK(raw json.RawMessage) (*ecdh.PublicKey, error) {
	var m map[string]json.RawMessage
	if len(raw) == 0 || json.Unmarshal(raw, &m) != nil || m == nil {
		return nil, errors.New("epk is not a JSON object")
	}
	var kty, crv, x, y string
	for k, v := range m {
		var dst *string
		switch k {
		case "kty":
			dst = &kty
		case "crv":
			dst = &crv
		case "x":
			dst = &x
		case "y":
			dst = &y
		default:
			// "d" among them: a private key has no place in a seal.
			return nil, fmt.Errorf("epk member %q", k)
		}
		if json.Unmarshal(v, dst) != nil {
			return nil, fmt.Errorf("epk member %q is not a string", k)
		}
	}
	if kty != "EC" || crv != "P-256" {
		return nil, fmt.Errorf("epk is kty %q crv %q, not an EC P-256 key", kty, crv)
	}
	xb, errX := decodeSealPart(x)
	yb, errY := decodeSealPart(y)
	if errX != nil || errY != nil || len(xb) != sealCoordSize || len(yb) != sealCoordSize {
		return nil, errors.New("epk x or y is not 32 bytes of base64url")
	}
	point := make([]byte, 0, sealPointSize)
	point = append(append(append(point, 4), xb...), yb...)
	// SECURITY: NewPublicKey refuses a point off the curve (an invalid-curve
	// attack would otherwise learn the key bit by bit) and the identity.
	pub, err := ecdh.P256().NewPublicKey(point)
	if err != nil {
		return nil, fmt.Errorf("epk: %w", err)
	}
	return pub, nil
}

// concatKDF is the Concat KDF of NIST SP 800-56A §5.8.1 as RFC 7518
// §4.6.2 uses it, with SHA-256: one round, so keyBits is at most 256.
// OtherInfo is AlgorithmID || PartyUInfo || PartyVInfo || SuppPubInfo, the
// first three length-prefixed, SuppPubInfo the key length in bits.
func concatKDF(z []byte, alg string, apu, apv []byte, keyBits int) []byte {
	if keyBits <= 0 || keyBits > 256 || keyBits%8 != 0 {
		panic("concatKDF: key length outside one SHA-256 round")
	}
	h := sha256.New()
	var n [4]byte
	put := func(v int) {
		binary.BigEndian.PutUint32(n[:], uint32(v))
		h.Write(n[:])
	}
	put(1) // round counter
	h.Write(z)
	put(len(alg))
	h.Write([]byte(alg))
	put(len(apu))
	h.Write(apu)
	put(len(apv))
	h.Write(apv)
	put(keyBits)
	return h.Sum(nil)[:keyBits/8]
}

// aesKeyUnwrapIV is the default initial value of RFC 3394 §2.2.3.1.
var aesKeyUnwrapIV = [8]byte{0xa6, 0xa6, 0xa6, 0xa6, 0xa6, 0xa6, 0xa6, 0xa6}

// aesKeyUnwrap is the key unwrap of RFC 3394 §2.2.2 (index-based form).
// The integrity check compares in constant time.
func aesKeyUnwrap(kek, wrapped []byte) ([]byte, error) {
	if len(wrapped)%8 != 0 || len(wrapped) < 24 {
		return nil, errors.New("wrapped key length is not a multiple of 8 of at least 24")
	}
	block, err := aes.NewCipher(kek)
	if err != nil {
		return nil, err
	}
	n := len(wrapped)/8 - 1
	r := make([]byte, n*8)
	copy(r, wrapped[8:])
	var b [16]byte
	copy(b[:8], wrapped[:8]) // A
	for j := 5; j >= 0; j-- {
		for i := n; i >= 1; i-- {
			// B = AES-1(K, (A ^ t) | R[i]), t = n*j+i; A = MSB(64, B); R[i] = LSB(64, B).
			t := uint64(n*j + i)
			binary.BigEndian.PutUint64(b[:8], binary.BigEndian.Uint64(b[:8])^t)
			copy(b[8:], r[(i-1)*8:i*8])
			block.Decrypt(b[:], b[:])
			copy(r[(i-1)*8:i*8], b[8:])
		}
	}
	if subtle.ConstantTimeCompare(b[:8], aesKeyUnwrapIV[:]) != 1 {
		return nil, errors.New("key unwrap integrity check failed")
	}
	return r, nil
}

// openSealJWE decrypts a compact JWE whose protected header (protected,
// the base64url text as sent) checkSealHeader has checked, with priv, the
// JoinService encryption key. epk is the header's epk member as checked.
// Every error is one of decryption (ReasonSealDecrypt) except an
// undecodable part (ReasonSealMalformed), as with go-jose before.
func openSealJWE(priv *ecdh.PrivateKey, protected string, epk json.RawMessage, encryptedKey, ivPart, ciphertextPart, tagPart string) ([]byte, error) {
	var parts [4][]byte
	for i, s := range []string{encryptedKey, ivPart, ciphertextPart, tagPart} {
		b, err := decodeSealPart(s)
		if err != nil {
			return nil, sealErr(ReasonSealMalformed, "part %d: %w", i+1, err)
		}
		parts[i] = b
	}
	ek, iv, ciphertext, tag := parts[0], parts[1], parts[2], parts[3]
	pub, err := parseSealEPK(epk)
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "%w", err)
	}
	if len(ek) != sealWrapped || len(iv) != sealIVSize || len(tag) != sealTagSize {
		return nil, sealErr(ReasonSealDecrypt, "encrypted key, IV or tag of %d, %d, %d bytes", len(ek), len(iv), len(tag))
	}
	z, err := priv.ECDH(pub)
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "key agreement: %w", err)
	}
	kek := concatKDF(z, sealKeyAlg, nil, nil, 256)
	cek, err := aesKeyUnwrap(kek, ek)
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "%w", err)
	}
	block, err := aes.NewCipher(cek)
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "%w", err)
	}
	gcm, err := cipher.NewGCM(block) // 12-byte nonce, 16-byte tag
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "%w", err)
	}
	// RFC 7516 §5.2 step 14: the additional data is the ASCII of the
	// protected header's base64url encoding, as sent.
	sealed := make([]byte, 0, len(ciphertext)+len(tag))
	sealed = append(append(sealed, ciphertext...), tag...)
	plain, err := gcm.Open(sealed[:0], iv, sealed, []byte(protected))
	if err != nil {
		return nil, sealErr(ReasonSealDecrypt, "%w", err)
	}
	return plain, nil
}
