package ca

import (
	"crypto/ecdsa"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

const testToken = "bcjt_jt_01k5w7c2v9m3.Yc1q3m1oS3m8fJ0l6h7Xg2s4r5t6u7v8w9x0y1z2A3B"

// requestFor returns the digest of a join request for csr, with a hostname
// that tells two requests for one CSR apart.
func requestFor(csr []byte, hostname string) []byte {
	return pki.JoinRequestDigest(&agentv1.JoinRequest{Csr: csr, Protocol: 1, Claims: &agentv1.Claims{Hostname: hostname}})
}

// R4.2: a seal opens with the JoinService key for the CSR and the request it
// was made for, and carries the documented header.
func TestSealOpenRoundTrip(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	req := requestFor(csr, "a")
	sealed, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(sealed, testToken) {
		t.Fatal("the token is visible in the seal")
	}
	h := protectedHeader(t, sealed)
	csrHash := base64.RawURLEncoding.EncodeToString(pki.CSRHash(csr))
	reqHash := base64.RawURLEncoding.EncodeToString(req)
	if h["alg"] != "ECDH-ES+A256KW" || h["enc"] != "A256GCM" || h["typ"] != "bcjt+jwe" ||
		h["iat"] != float64(t0.Unix()) || h["csr"] != csrHash || h["req"] != reqHash || h["epk"] == nil || len(h) != 7 {
		t.Errorf("header = %v", h)
	}
	got, err := Open(key, sealed, csr, req, t0)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if got != testToken {
		t.Errorf("Open = %q", got)
	}
}

// R4.2: a seal is accepted from SealMaxFuture before its iat to SealMaxAge
// after it, both bounds included, and refused outside with its own reason.
func TestOpenTimes(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	req := requestFor(csr, "a")
	sealed, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		now    time.Time
		reason string // "" opens
	}{
		{"at iat", t0, ""},
		{"exactly 10 min old", t0.Add(10 * time.Minute), ""},
		{"10 min and 1 ns old", t0.Add(10*time.Minute + time.Nanosecond), ReasonSealExpired},
		{"a day old", t0.Add(24 * time.Hour), ReasonSealExpired},
		{"exactly 5 min ahead", t0.Add(-5 * time.Minute), ""},
		{"5 min and 1 ns ahead", t0.Add(-5*time.Minute - time.Nanosecond), ReasonSealFuture},
		{"a year ahead", t0.Add(-365 * 24 * time.Hour), ReasonSealFuture},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok, err := Open(key, sealed, csr, req, tt.now)
			if tt.reason == "" {
				if err != nil || tok != testToken {
					t.Fatalf("Open = %q, %v", tok, err)
				}
				return
			}
			if reason, _ := SealReason(err); reason != tt.reason || tok != "" {
				t.Fatalf("Open = %q, %v; want reason %s", tok, err, tt.reason)
			}
		})
	}
	// The bounds are the documented ones.
	if pki.SealMaxAge != 10*time.Minute || pki.SealMaxFuture != 5*time.Minute {
		t.Fatalf("SealMaxAge %s, SealMaxFuture %s", pki.SealMaxAge, pki.SealMaxFuture)
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

// R4.2: everything but a well-formed, fresh seal for this CSR, request and
// key is refused, with a reason the caller can record.
func TestOpenRefusals(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	otherCSR := newCSR(t, newP256(t))
	req := requestFor(csr, "a")
	good, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		t.Fatal(err)
	}
	csrHash := base64.RawURLEncoding.EncodeToString(pki.CSRHash(csr))
	reqHash := base64.RawURLEncoding.EncodeToString(req)
	hdr := func(edit func(map[string]any)) map[string]any {
		h := map[string]any{"typ": pki.SealType, "iat": t0.Unix(), "csr": csrHash, "req": reqHash}
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

	jwe := func(edit func(map[string]any)) string {
		return jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(edit), false, testToken)
	}
	// A seal for this request that is stale, encrypted to another key: the
	// time is checked before any ECDH work.
	staleOtherKey := jweWith(t, &newP256(t).PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(func(h map[string]any) { h["iat"] = t0.Add(-time.Hour).Unix() }), false, testToken)

	tests := []struct {
		name   string
		seal   string
		key    *ecdsa.PrivateKey
		csr    []byte
		reason string
	}{
		{"another CSR", good, key, otherCSR, ReasonSealCSRMismatch},
		{"another request", jwe(func(h map[string]any) { h["req"] = base64.RawURLEncoding.EncodeToString(requestFor(csr, "b")) }), key, csr, ReasonSealRequestMismatch},
		{"no req", jwe(func(h map[string]any) { delete(h, "req") }), key, csr, ReasonSealHeader},
		{"empty req", jwe(func(h map[string]any) { h["req"] = "" }), key, csr, ReasonSealHeader},
		{"req not a string", jwe(func(h map[string]any) { h["req"] = 7 }), key, csr, ReasonSealHeader},
		{"padded req", jwe(func(h map[string]any) { h["req"] = reqHash + "=" }), key, csr, ReasonSealRequestMismatch},
		{"standard base64 req", jwe(func(h map[string]any) { h["req"] = base64.StdEncoding.EncodeToString(req) }), key, csr, ReasonSealRequestMismatch},
		{"req of the CSR hash", jwe(func(h map[string]any) { h["req"] = csrHash }), key, csr, ReasonSealRequestMismatch},
		{"iat 11 min old", jwe(func(h map[string]any) { h["iat"] = t0.Add(-11 * time.Minute).Unix() }), key, csr, ReasonSealExpired},
		{"iat 6 min ahead", jwe(func(h map[string]any) { h["iat"] = t0.Add(6 * time.Minute).Unix() }), key, csr, ReasonSealFuture},
		{"stale, to another key", staleOtherKey, key, csr, ReasonSealExpired},
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
		{"oversized token", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), false, strings.Repeat("a", pki.MaxSealedTokenSize+1)), key, csr, ReasonSealPlaintext},
		{"not UTF-8", jweWith(t, &key.PublicKey, jose.ECDH_ES_A256KW, jose.A256GCM, hdr(nil), false, "\xff\xfe"), key, csr, ReasonSealPlaintext},
		{"tampered ciphertext", tamper(3), key, csr, ReasonSealDecrypt},
		{"tampered tag", tamper(4), key, csr, ReasonSealDecrypt},
		{"tampered encrypted key", tamper(1), key, csr, ReasonSealDecrypt},
		{"tampered header", headerSwapped, key, csr, ReasonSealDecrypt},
		{"oversized input", good + strings.Repeat("A", pki.MaxSealSize), key, csr, ReasonSealMalformed},
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
			tok, err := Open(tt.key, tt.seal, tt.csr, req, t0)
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
	req := requestFor(csr, "a")
	p384 := mustP384(t).Public().(*ecdsa.PublicKey)
	for name, f := range map[string]func() (string, error){
		"P-384 key":      func() (string, error) { return pki.Seal(p384, testToken, csr, req, t0) },
		"nil key":        func() (string, error) { return pki.Seal(nil, testToken, csr, req, t0) },
		"empty token":    func() (string, error) { return pki.Seal(&key.PublicKey, "", csr, req, t0) },
		"long token":     func() (string, error) { return pki.Seal(&key.PublicKey, strings.Repeat("a", 1025), csr, req, t0) },
		"no CSR":         func() (string, error) { return pki.Seal(&key.PublicKey, testToken, nil, req, t0) },
		"no digest":      func() (string, error) { return pki.Seal(&key.PublicKey, testToken, csr, nil, t0) },
		"a short digest": func() (string, error) { return pki.Seal(&key.PublicKey, testToken, csr, req[:31], t0) },
	} {
		if _, err := f(); err == nil {
			t.Errorf("%s: Seal succeeded", name)
		}
	}
	// Open refuses a digest that is not one, before looking at the seal.
	sealed, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(key, sealed, csr, req[:16], t0); err == nil {
		t.Error("Open with a 16-byte digest succeeded")
	}
}

// R4.2: Open never panics, whatever the input; it opens only the one seal
// made for this request, and every refusal carries the reason the server
// records.
func FuzzOpen(f *testing.F) {
	key := newP256(f)
	csr := newCSR(f, newP256(f))
	req := requestFor(csr, "a")
	good, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add("")
	f.Add("....")
	f.Add(good[:len(good)/2])
	parts := strings.Split(good, ".")
	f.Add(parts[0] + ".." + strings.Join(parts[2:], "."))
	f.Fuzz(func(t *testing.T, s string) {
		tok, err := Open(key, s, csr, req, t0)
		if err == nil {
			if tok != testToken || s != good {
				t.Fatalf("Open accepted %q as %q", s, tok)
			}
			return
		}
		if _, ok := SealReason(err); !ok {
			t.Fatalf("error without a reason: %v", err)
		}
	})
}

func BenchmarkSeal(b *testing.B) {
	key := newP256(b)
	csr := newCSR(b, newP256(b))
	req := requestFor(csr, "a")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0); err != nil {
			b.Fatal(err)
		}
	}
}

// sealedForBench is a key, a CSR, its request digest and a seal of
// testToken for them, for the Open benchmarks.
func sealedForBench(b *testing.B) (*ecdsa.PrivateKey, []byte, []byte, string) {
	key := newP256(b)
	csr := newCSR(b, newP256(b))
	req := requestFor(csr, "a")
	sealed, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		b.Fatal(err)
	}
	return key, csr, req, sealed
}

func BenchmarkOpen(b *testing.B) {
	key, csr, req, sealed := sealedForBench(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Open(key, sealed, csr, req, t0); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkSealOpenerOpen is Open with the key converted once.
func BenchmarkSealOpenerOpen(b *testing.B) {
	key, csr, req, sealed := sealedForBench(b)
	o, err := NewSealOpener(key)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := o.Open(sealed, csr, req, t0); err != nil {
			b.Fatal(err)
		}
	}
}
