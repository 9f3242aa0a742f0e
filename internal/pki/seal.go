package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-jose/go-jose/v4"
)

// Seal format (R4.2).
const (
	// SealType is the protected "typ" header of a sealed join token.
	SealType = "bcjt+jwe"
	// MaxSealSize bounds the compact JWE Open accepts.
	MaxSealSize = 8 << 10
	// MaxSealedTokenSize bounds the sealed plaintext (the bearer token).
	MaxSealedTokenSize = 1 << 10
)

// Reasons an Open fails, recorded by the caller (e.g. in
// security.join.refused) and never shown to the agent.
const (
	// ReasonSealMalformed: too large, not compact JWE, undecodable.
	ReasonSealMalformed = "seal-malformed"
	// ReasonSealAlgorithm: alg or enc other than ECDH-ES+A256KW / A256GCM.
	ReasonSealAlgorithm = "seal-algorithm"
	// ReasonSealHeader: typ, iat or csr missing or wrong, or an unexpected
	// header (zip, crit, ...).
	ReasonSealHeader = "seal-header"
	// ReasonSealCSRMismatch: the seal was made for another CSR.
	ReasonSealCSRMismatch = "seal-csr-mismatch"
	// ReasonSealDecrypt: not encrypted to this key, or tampered with.
	ReasonSealDecrypt = "seal-decrypt"
	// ReasonSealPlaintext: the sealed token is empty, too long or not UTF-8.
	ReasonSealPlaintext = "seal-plaintext"
	// ReasonSealRequestMismatch: the seal was made for another request
	// (its claims, role, node id, ... were changed on the way).
	ReasonSealRequestMismatch = "seal-request-mismatch"
	// ReasonSealExpired: the seal's iat is more than SealMaxAge ago.
	ReasonSealExpired = "seal-expired"
	// ReasonSealFuture: the seal's iat is more than SealMaxFuture ahead.
	ReasonSealFuture = "seal-iat-future"
)

// Seal freshness. A seal older than SealMaxAge is refused, so a captured
// request cannot be replayed later; a machine retries with a fresh seal.
// SealMaxFuture bounds an iat ahead of the server's clock (a machine's
// clock may run a little fast), so a future-dated seal cannot extend the
// replay window.
const (
	SealMaxAge    = 10 * time.Minute
	SealMaxFuture = 5 * time.Minute
)

// SealError is the error Open returns. Reason is one of the Reason*
// constants. Error() includes internal detail for logs; callers answering an
// agent must not send it (every refusal is the same ACCESS_DENIED).
type SealError struct {
	Reason string
	Err    error
}

func (e *SealError) Error() string {
	if e.Err == nil {
		return "open seal: " + e.Reason
	}
	return "open seal: " + e.Reason + ": " + e.Err.Error()
}

func (e *SealError) Unwrap() error { return e.Err }

// SealReason returns the Reason of a SealError inside err.
func SealReason(err error) (string, bool) {
	var se *SealError
	if errors.As(err, &se) {
		return se.Reason, true
	}
	return "", false
}

func sealErr(reason string, format string, args ...any) error {
	return &SealError{Reason: reason, Err: fmt.Errorf(format, args...)}
}

// CSRHash returns the SHA-256 of a CSR's DER: the seal's "csr" header (in
// base64url) and the join response's csr_sha256.
func CSRHash(csrDER []byte) []byte {
	sum := sha256.Sum256(csrDER)
	return sum[:]
}

// Seal encrypts token to encPub (the pinned JoinService encryption key, P-256)
// as a compact JWE: alg ECDH-ES+A256KW, enc A256GCM, protected header typ
// "bcjt+jwe", iat (unix seconds) and csr (base64url, unpadded, of the
// SHA-256 of csrDER). The header is authenticated as AES-GCM additional data,
// so the gateway that relays the seal can neither read the token nor move it
// to a CSR of its own.
func Seal(encPub *ecdsa.PublicKey, token string, csrDER, reqDigest []byte, iat time.Time) (string, error) {
	if encPub == nil || !isP256(encPub) {
		return "", errors.New("seal: the encryption key must be ECDSA P-256")
	}
	if token == "" || len(token) > MaxSealedTokenSize || !utf8.ValidString(token) {
		return "", fmt.Errorf("seal: the token must be 1 to %d bytes of UTF-8", MaxSealedTokenSize)
	}
	if len(csrDER) == 0 {
		return "", errors.New("seal: empty CSR")
	}
	opts := (&jose.EncrypterOptions{}).
		WithType(SealType).
		WithHeader("iat", iat.Unix()).
		WithHeader("csr", base64.RawURLEncoding.EncodeToString(CSRHash(csrDER))).
		WithHeader("req", base64.RawURLEncoding.EncodeToString(reqDigest))
	enc, err := jose.NewEncrypter(jose.A256GCM, jose.Recipient{Algorithm: jose.ECDH_ES_A256KW, Key: encPub}, opts)
	if err != nil {
		return "", fmt.Errorf("make encrypter: %w", err)
	}
	obj, err := enc.Encrypt([]byte(token))
	if err != nil {
		return "", fmt.Errorf("encrypt token: %w", err)
	}
	compact, err := obj.CompactSerialize()
	if err != nil {
		return "", fmt.Errorf("serialize seal: %w", err)
	}
	return compact, nil
}

// allowedSealHeader reports whether a seal may carry protected header k.
// Anything else (zip, crit, jku, x5u, kid, ...) is refused: nothing Seal
// makes sets it, and zip in particular would let a small input inflate.
func allowedSealHeader(k string) bool {
	switch k {
	case "alg", "enc", "epk", "typ", "iat", "csr", "req":
		return true
	}
	return false
}

// Open decrypts a seal made by Seal with encKey (the JoinService encryption
// key) and returns the token. csrDER is the CSR that came with the seal; a
// seal made for another CSR is refused. Every failure is a *SealError whose
// Reason the caller records.
//
// Open deliberately does not check iat for freshness: machines that join
// often have unsynchronized clocks, and a seal is already bound to one CSR
// (whose key only the machine holds) and to the token's own expiry and uses,
// which JoinService checks at the database's clock.
func Open(encKey *ecdsa.PrivateKey, compact string, csrDER, reqDigest []byte, now time.Time) (string, error) {
	if encKey == nil || !isP256(&encKey.PublicKey) {
		return "", errors.New("open seal: the encryption key must be ECDSA P-256")
	}
	// SECURITY: bound the input before any parsing or ECDH work.
	if len(compact) == 0 || len(compact) > MaxSealSize {
		return "", sealErr(ReasonSealMalformed, "size %d outside 1..%d", len(compact), MaxSealSize)
	}
	if strings.Count(compact, ".") != 4 {
		return "", sealErr(ReasonSealMalformed, "not compact JWE")
	}
	protected, _, _ := strings.Cut(compact, ".")
	if err := checkSealHeader(protected, csrDER, reqDigest, now); err != nil {
		return "", err
	}
	// The allow-lists are enforced again by go-jose on the same bytes.
	obj, err := jose.ParseEncryptedCompact(compact, []jose.KeyAlgorithm{jose.ECDH_ES_A256KW}, []jose.ContentEncryption{jose.A256GCM})
	if err != nil {
		return "", sealErr(ReasonSealMalformed, "parse: %w", err)
	}
	plain, err := obj.Decrypt(encKey)
	if err != nil {
		return "", sealErr(ReasonSealDecrypt, "decrypt: %w", err)
	}
	if len(plain) == 0 || len(plain) > MaxSealedTokenSize || !utf8.Valid(plain) {
		return "", sealErr(ReasonSealPlaintext, "plaintext of %d bytes", len(plain))
	}
	return string(plain), nil
}

// checkSealHeader decodes the protected header and checks it strictly before
// any key agreement: algorithms, typ, iat, and the CSR binding.
func checkSealHeader(protected string, csrDER, reqDigest []byte, now time.Time) error {
	raw, err := base64.RawURLEncoding.DecodeString(protected)
	if err != nil {
		return sealErr(ReasonSealMalformed, "protected header: %w", err)
	}
	var h map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&h); err != nil || dec.More() {
		return sealErr(ReasonSealMalformed, "protected header is not a JSON object")
	}
	var alg, enc string
	if json.Unmarshal(h["alg"], &alg) != nil || json.Unmarshal(h["enc"], &enc) != nil {
		return sealErr(ReasonSealMalformed, "alg or enc is not a string")
	}
	if alg != string(jose.ECDH_ES_A256KW) || enc != string(jose.A256GCM) {
		return sealErr(ReasonSealAlgorithm, "alg %q enc %q", alg, enc)
	}
	for k := range h {
		if !allowedSealHeader(k) {
			return sealErr(ReasonSealHeader, "unexpected header %q", k)
		}
	}
	var typ string
	if json.Unmarshal(h["typ"], &typ) != nil || typ != SealType {
		return sealErr(ReasonSealHeader, "typ is not %s", SealType)
	}
	// Decoding into any (not json.Number, which also takes a quoted
	// number) keeps iat a JSON number.
	var v any
	d := json.NewDecoder(bytes.NewReader(h["iat"]))
	d.UseNumber()
	if h["iat"] == nil || d.Decode(&v) != nil {
		return sealErr(ReasonSealHeader, "iat missing")
	}
	iat, ok := v.(json.Number)
	if !ok {
		return sealErr(ReasonSealHeader, "iat is not a number")
	}
	n, err := iat.Int64()
	if err != nil || n <= 0 {
		return sealErr(ReasonSealHeader, "iat is not positive unix seconds")
	}
	var csr string
	if json.Unmarshal(h["csr"], &csr) != nil || csr == "" {
		return sealErr(ReasonSealHeader, "csr missing")
	}
	want := base64.RawURLEncoding.EncodeToString(CSRHash(csrDER))
	if subtle.ConstantTimeCompare([]byte(csr), []byte(want)) != 1 {
		return sealErr(ReasonSealCSRMismatch, "the seal was made for another CSR")
	}
	var req string
	if json.Unmarshal(h["req"], &req) != nil || req == "" {
		return sealErr(ReasonSealHeader, "req missing")
	}
	wantReq := base64.RawURLEncoding.EncodeToString(reqDigest)
	if subtle.ConstantTimeCompare([]byte(req), []byte(wantReq)) != 1 {
		return sealErr(ReasonSealRequestMismatch, "the seal was made for another request")
	}
	at := time.Unix(n, 0)
	if now.Sub(at) > SealMaxAge {
		return sealErr(ReasonSealExpired, "iat %s is more than %s before %s", at, SealMaxAge, now)
	}
	if at.Sub(now) > SealMaxFuture {
		return sealErr(ReasonSealFuture, "iat %s is more than %s after %s", at, SealMaxFuture, now)
	}
	return nil
}
