package pki

import (
	"crypto/ecdsa"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
)

const testToken = "bcjt_jt_01k5w7c2v9m3.Yc1q3m1oS3m8fJ0l6h7Xg2s4r5t6u7v8w9x0y1z2A3B"

// R4.2: a seal opens with the JoinService key for the CSR it was made for,
// and carries the documented header.
func TestSealOpenRoundTrip(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	sealed, err := Seal(&key.PublicKey, testToken, csr, t0)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(sealed, testToken) {
		t.Fatal("the token is visible in the seal")
	}
	h := protectedHeader(t, sealed)
	csrHash := base64.RawURLEncoding.EncodeToString(CSRHash(csr))
	if h["alg"] != "ECDH-ES+A256KW" || h["enc"] != "A256GCM" || h["typ"] != "bcjt+jwe" ||
		h["iat"] != float64(t0.Unix()) || h["csr"] != csrHash || h["epk"] == nil {
		t.Errorf("header = %v", h)
	}
	got, err := Open(key, sealed, csr)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if got != testToken {
		t.Errorf("Open = %q", got)
	}
	// iat freshness is deliberately not checked: a machine with a clock years
	// off still joins.
	old, _ := Seal(&key.PublicKey, testToken, csr, time.Unix(1, 0))
	if _, err := Open(key, old, csr); err != nil {
		t.Errorf("Open of an old iat: %v", err)
	}
}

func protectedHeader(t *testing.T, compact string) map[string]any {
	t.Helper()
	p, _, _ := strings.Cut(compact, ".")
	raw, err := base64.RawURLEncoding.DecodeString(p)
	if err != nil {
		t.Fatal(err)
	}
	var h map[string]any
	if err := json.Unmarshal(raw, &h); err != nil {
		t.Fatal(err)
	}
	return h
}

// jweWith builds a JWE with go-jose directly, to make seals Seal never would.
func jweWith(t *testing.T, pub *ecdsa.PublicKey, alg jose.KeyAlgorithm, enc jose.ContentEncryption, headers map[string]any, zip bool, plaintext string) string {
	t.Helper()
	opts := &jose.EncrypterOptions{}
	for k, v := range headers {
		opts = opts.WithHeader(jose.HeaderKey(k), v)
	}
	if zip {
		opts.Compression = jose.DEFLATE
	}
	e, err := jose.NewEncrypter(enc, jose.Recipient{Algorithm: alg, Key: pub}, opts)
	if err != nil {
		t.Fatal(err)
	}
	obj, err := e.Encrypt([]byte(plaintext))
	if err != nil {
		t.Fatal(err)
	}
	s, err := obj.CompactSerialize()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// R4.2: everything but a well-formed seal for this CSR and key is refused,
// with a reason the caller can record.
func TestOpenRefusals(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	otherCSR := newCSR(t, newP256(t))
	good, err := Seal(&key.PublicKey, testToken, csr, t0)
	if err != nil {
		t.Fatal(err)
	}
	csrHash := base64.RawURLEncoding.EncodeToString(CSRHash(csr))
	hdr := func(edit func(map[string]any)) map[string]any {
		h := map[string]any{"typ": SealType, "iat": t0.Unix(), "csr": csrHash}
		if edit != nil {
			edit(h)
		}
		return h
	}
	parts := strings.Split(good, ".")
	tamper := func(i int) string {
		p := append([]string(nil), parts...)
		b, _ := base64.RawURLEncoding.DecodeString(p[i])
		b[0] ^= 1
		p[i] = base64.RawURLEncoding.EncodeToString(b)
		return strings.Join(p, ".")
	}
	// A header with iat changed: the header is AES-GCM additional data.
	h := protectedHeader(t, good)
	h["iat"] = t0.Unix() + 1
	rawH, _ := json.Marshal(h)
	headerSwapped := base64.RawURLEncoding.EncodeToString(rawH) + good[strings.Index(good, "."):]

	tests := []struct {
		name   string
		seal   string
		key    *ecdsa.PrivateKey
		csr    []byte
		reason string
	}{
		{"another CSR", good, key, otherCSR, ReasonSealCSRMismatch},
		{"another key", good, newP256(t), csr, ReasonSealDecrypt},
		{"ECDH-ES direct", jweWith(t, &key.PublicKey, jose.ECDH_ES, jose.A256GCM, hdr(nil), false, testToken), key, csr, ReasonSealAlgorithm},
		{"A128GCM", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A128GCM, hdr(nil), false, testToken), key, csr, ReasonSealAlgorithm},
		{"A256CBC-HS512", jweWith(t, &key.PublicKey, jose.ECDH_ES_A128KW, jose.A256CBC_HS512, hdr(nil), false, testToken), key, csr, ReasonSealAlgorithm},
		{"wrong typ", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["typ"] = "JWT" }), false, testToken), key, csr, ReasonSealHeader},
		{"no typ", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { delete(h, "typ") }), false, testToken), key, csr, ReasonSealHeader},
		{"no iat", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { delete(h, "iat") }), false, testToken), key, csr, ReasonSealHeader},
		{"string iat", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["iat"] = "1700000000" }), false, testToken), key, csr, ReasonSealHeader},
		{"fractional iat", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["iat"] = 1.5 }), false, testToken), key, csr, ReasonSealHeader},
		{"no csr", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { delete(h, "csr") }), false, testToken), key, csr, ReasonSealHeader},
		{"padded csr", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["csr"] = csrHash + "=" }), false, testToken), key, csr, ReasonSealCSRMismatch},
		{"extra header", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["kid"] = "x" }), false, testToken), key, csr, ReasonSealHeader},
		{"zip", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), true, testToken), key, csr, ReasonSealHeader},
		{"empty token", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), false, ""), key, csr, ReasonSealPlaintext},
		{"oversized token", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), false, strings.Repeat("a", MaxSealedTokenSize+1)), key, csr, ReasonSealPlaintext},
		{"not UTF-8", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), false, "\xff\xfe"), key, csr, ReasonSealPlaintext},
		{"tampered ciphertext", tamper(3), key, csr, ReasonSealDecrypt},
		{"tampered tag", tamper(4), key, csr, ReasonSealDecrypt},
		{"tampered encrypted key", tamper(1), key, csr, ReasonSealDecrypt},
		{"tampered header", headerSwapped, key, csr, ReasonSealDecrypt},
		{"oversized input", good + strings.Repeat("A", MaxSealSize), key, csr, ReasonSealMalformed},
		{"empty", "", key, csr, ReasonSealMalformed},
		{"four parts", strings.Join(parts[:4], "."), key, csr, ReasonSealMalformed},
		{"six parts", good + ".x", key, csr, ReasonSealMalformed},
		{"JSON serialization", `{"protected":"` + parts[0] + `"}`, key, csr, ReasonSealMalformed},
		{"header not base64", "!!!." + strings.Join(parts[1:], "."), key, csr, ReasonSealMalformed},
		{"header not JSON", base64.RawURLEncoding.EncodeToString([]byte("[1]")) + good[strings.Index(good, "."):], key, csr, ReasonSealMalformed},
		{"alg none", base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","enc":"A256GCM"}`)) + good[strings.Index(good, "."):], key, csr, ReasonSealAlgorithm},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok, err := Open(tt.key, tt.seal, tt.csr)
			reason, ok := SealReason(err)
			if !ok || reason != tt.reason {
				t.Errorf("Open = %q, %v; want reason %s", tok, err, tt.reason)
			}
			if tok != "" {
				t.Errorf("Open returned a token with an error")
			}
		})
	}
}

// R4.2: Seal refuses what Open would refuse.
func TestSealRefusals(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, key)
	p384 := mustP384(t).Public().(*ecdsa.PublicKey)
	for name, f := range map[string]func() (string, error){
		"P-384 key":   func() (string, error) { return Seal(p384, testToken, csr, t0) },
		"nil key":     func() (string, error) { return Seal(nil, testToken, csr, t0) },
		"empty token": func() (string, error) { return Seal(&key.PublicKey, "", csr, t0) },
		"long token":  func() (string, error) { return Seal(&key.PublicKey, strings.Repeat("a", 1025), csr, t0) },
		"no CSR":      func() (string, error) { return Seal(&key.PublicKey, testToken, nil, t0) },
	} {
		if _, err := f(); err == nil {
			t.Errorf("%s: Seal succeeded", name)
		}
	}
}

// R4.2: Open never panics, whatever the input.
func FuzzOpen(f *testing.F) {
	key := newP256(f)
	csr := newCSR(f, newP256(f))
	good, err := Seal(&key.PublicKey, testToken, csr, t0)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add("")
	f.Add("....")
	f.Add(good[:len(good)/2])
	f.Fuzz(func(t *testing.T, s string) {
		tok, err := Open(key, s, csr)
		if err == nil && tok != testToken {
			t.Fatalf("Open accepted %q as %q", s, tok)
		}
		if err != nil {
			if _, ok := SealReason(err); !ok {
				t.Fatalf("error without a reason: %v", err)
			}
		}
	})
}

func BenchmarkSeal(b *testing.B) {
	key := newP256(b)
	csr := newCSR(b, newP256(b))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Seal(&key.PublicKey, testToken, csr, t0); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkOpen(b *testing.B) {
	key := newP256(b)
	csr := newCSR(b, newP256(b))
	sealed, err := Seal(&key.PublicKey, testToken, csr, t0)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Open(key, sealed, csr); err != nil {
			b.Fatal(err)
		}
	}
}
