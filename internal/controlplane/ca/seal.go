package ca

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
	"sync"
	"time"
	"unicode/utf8"

	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/go-jose/go-jose/v4"
)

// Seal format (R4.2).

// Reasons an Open fails, recorded by the caller (e.g. in
// security.join.refused) and never shown to the agent.
const (
	// ReasonSealMalformed: too large, not compact JWE, undecodable.
	ReasonSealMalformed = "seal-malformed"
	// ReasonSealAlgorithm: alg or enc other than ECDH-ES+A256KW / A256GCM.
	ReasonSealAlgorithm = "seal-algorithm"
	// ReasonSealHeader: typ, iat, csr or req missing or wrong, or an
	// unexpected header (zip, crit, ...).
	ReasonSealHeader = "seal-header"
	// ReasonSealCSRMismatch: the seal was made for another CSR.
	ReasonSealCSRMismatch = "seal-csr-mismatch"
	// ReasonSealRequestMismatch: the seal was made for another join request
	// (its req header is not the digest of the request it came with): the
	// relay changed the request, or moved the seal to a request of its own.
	ReasonSealRequestMismatch = "seal-request-mismatch"
	// ReasonSealExpired: iat is more than SealMaxAge before the server's
	// clock.
	ReasonSealExpired = "seal-expired"
	// ReasonSealFuture: iat is more than SealMaxFuture after the server's
	// clock.
	ReasonSealFuture = "seal-iat-future"
	// ReasonSealDecrypt: not encrypted to this key, or tampered with.
	ReasonSealDecrypt = "seal-decrypt"
	// ReasonSealPlaintext: the sealed token is empty, too long or not UTF-8.
	ReasonSealPlaintext = "seal-plaintext"
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
// key) and returns the token. csrDER is the CSR that came with the seal and
// reqDigest the JoinRequestDigest of the request that carried it; a seal
// made for another CSR or another request is refused. now is the server's
// clock: a seal whose iat is more than SealMaxAge before now, or more than
// SealMaxFuture after it, is refused. Every failure is a *SealError whose
// Reason the caller records.
//
// All header checks, the binding and the time included, run before any
// ECDH work, so a refused seal costs no key agreement.
//
// Why iat is checked (R4.2): the digest binds the seal to one request, and
// a request that arrives again gets the answer stored for it (R4.9), so a
// replay of a whole request gains nothing while that answer is kept; the
// age bound keeps a captured request from being presented after its stored
// answer is gone, when it would be admitted anew. The price is that a
// machine's clock must be within SealMaxFuture of the server's and a seal
// used within SealMaxAge: bcd seals again on each attempt, and a machine
// whose clock is off is refused with seal-expired or seal-iat-future, which
// the operator reads in security.join.refused.
func Open(encKey *ecdsa.PrivateKey, compact string, csrDER, reqDigest []byte, now time.Time) (string, error) {
	if encKey == nil || !pki.IsP256(&encKey.PublicKey) {
		return "", errors.New("open seal: the encryption key must be ECDSA P-256")
	}
	return openSeal(encKey, compact, csrDER, reqDigest, now)
}

// SealOpener is Open for one encryption key, checked once. It is safe for
// concurrent use.
type SealOpener struct {
	key *ecdsa.PrivateKey
}

// NewSealOpener checks encKey, the JoinService encryption key (ECDSA
// P-256), for opening seals.
func NewSealOpener(encKey *ecdsa.PrivateKey) (*SealOpener, error) {
	if encKey == nil || !pki.IsP256(&encKey.PublicKey) {
		return nil, errors.New("open seal: the encryption key must be ECDSA P-256")
	}
	return &SealOpener{key: encKey}, nil
}

// Open is the package's Open with o's key.
func (o *SealOpener) Open(compact string, csrDER, reqDigest []byte, now time.Time) (string, error) {
	return openSeal(o.key, compact, csrDER, reqDigest, now)
}

// openSeal is Open for a checked key: the header checks, then go-jose
// parses and decrypts with the same algorithm allow-lists.
func openSeal(encKey *ecdsa.PrivateKey, compact string, csrDER, reqDigest []byte, now time.Time) (string, error) {
	if len(reqDigest) != sha256.Size {
		return "", fmt.Errorf("open seal: the request digest must be %d bytes (JoinRequestDigest)", sha256.Size)
	}
	// SECURITY: bound the input before any parsing or ECDH work.
	if len(compact) == 0 || len(compact) > pki.MaxSealSize {
		return "", sealErr(ReasonSealMalformed, "size %d outside 1..%d", len(compact), pki.MaxSealSize)
	}
	if strings.Count(compact, ".") != 4 {
		return "", sealErr(ReasonSealMalformed, "not compact JWE")
	}
	parts := strings.Split(compact, ".")
	if err := checkSealHeader(parts[0], csrDER, reqDigest, now); err != nil {
		return "", err
	}
	for i, p := range parts[1:] {
		if !canonicalBase64URL(p) {
			return "", sealErr(ReasonSealMalformed, "part %d is not canonical base64url", i+1)
		}
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
	if len(plain) == 0 || len(plain) > pki.MaxSealedTokenSize || !utf8.Valid(plain) {
		return "", sealErr(ReasonSealPlaintext, "plaintext of %d bytes", len(plain))
	}
	return string(plain), nil
}

// canonicalBase64URL reports whether s is the one unpadded base64url form
// of what it decodes to. go-jose's decoder also takes CR and LF anywhere
// and non-zero trailing bits, which would give one seal many spellings.
func canonicalBase64URL(s string) bool {
	b, err := base64.RawURLEncoding.Strict().DecodeString(s)
	return err == nil && base64.RawURLEncoding.EncodedLen(len(b)) == len(s)
}

// checkSealHeader decodes the protected header and checks it strictly before
// any key agreement: algorithms, typ, iat, the CSR and request bindings, and
// iat against now.
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
	if json.Unmarshal(h["typ"], &typ) != nil || typ != pki.SealType {
		return sealErr(ReasonSealHeader, "typ is not %s", pki.SealType)
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
	iatSec, err := iat.Int64()
	if err != nil || iatSec <= 0 {
		return sealErr(ReasonSealHeader, "iat is not positive unix seconds")
	}
	var csr string
	if json.Unmarshal(h["csr"], &csr) != nil || csr == "" {
		return sealErr(ReasonSealHeader, "csr missing")
	}
	want := base64.RawURLEncoding.EncodeToString(pki.CSRHash(csrDER))
	if subtle.ConstantTimeCompare([]byte(csr), []byte(want)) != 1 {
		return sealErr(ReasonSealCSRMismatch, "the seal was made for another CSR")
	}
	var req string
	if json.Unmarshal(h["req"], &req) != nil || req == "" {
		return sealErr(ReasonSealHeader, "req missing")
	}
	// The encoding is compared, not decoded: one digest has one unpadded
	// base64url form, and anything else is another request.
	wantReq := base64.RawURLEncoding.EncodeToString(reqDigest)
	if subtle.ConstantTimeCompare([]byte(req), []byte(wantReq)) != 1 {
		return sealErr(ReasonSealRequestMismatch, "the seal was made for another join request")
	}
	issued := time.Unix(iatSec, 0)
	if age := now.Sub(issued); age > pki.SealMaxAge {
		return sealErr(ReasonSealExpired, "iat %s is %s before now, more than %s", issued.UTC().Format(time.RFC3339), age, pki.SealMaxAge)
	}
	if ahead := issued.Sub(now); ahead > pki.SealMaxFuture {
		return sealErr(ReasonSealFuture, "iat %s is %s after now, more than %s", issued.UTC().Format(time.RFC3339), ahead, pki.SealMaxFuture)
	}
	return nil
}

// SealOpeners opens seals made to any of a bundle's opening keys (the
// current join-encryption key and, while it rotates, the next or previous
// one), holding one SealOpener per key. It is safe for concurrent use.
type SealOpeners struct {
	mu   sync.Mutex
	keys map[*ecdsa.PrivateKey]*SealOpener
}

// Open opens compact with the first of keys that opens it; when none does
// it returns the current key's (keys[0]) error. Header checks come first
// for every key, so a refused seal still costs no key agreement.
func (s *SealOpeners) Open(keys []*ecdsa.PrivateKey, compact string, csrDER, reqDigest []byte, now time.Time) (string, error) {
	var first error
	for i, k := range keys {
		o, err := s.opener(k)
		if err != nil {
			return "", err
		}
		tok, err := o.Open(compact, csrDER, reqDigest, now)
		if err == nil {
			return tok, nil
		}
		if i == 0 {
			first = err
		}
		if r, ok := SealReason(err); !ok || r != ReasonSealDecrypt {
			// Not a question of which key: every key would say the same.
			return "", first
		}
	}
	return "", first
}

func (s *SealOpeners) opener(k *ecdsa.PrivateKey) (*SealOpener, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.keys[k]; ok {
		return o, nil
	}
	o, err := NewSealOpener(k)
	if err != nil {
		return nil, err
	}
	if s.keys == nil || len(s.keys) > 16 {
		s.keys = map[*ecdsa.PrivateKey]*SealOpener{}
	}
	s.keys[k] = o
	return o, nil
}
