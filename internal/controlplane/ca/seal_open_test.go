package ca

import (
	"crypto/ecdh"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"

	"strings"
	"testing"
	"unicode/utf8"

	"github.com/better-compute/better-compute/internal/shared/pki"
)

// reheader returns compact with its protected header decoded, edited and
// encoded again (as JSON from a map: the members in another order than
// go-jose writes them, which is fine, the header is used as sent).
func reheader(t *testing.T, compact string, edit func(h map[string]any)) string {
	t.Helper()
	h := protectedHeader(t, compact)
	edit(h)
	raw, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	return base64.RawURLEncoding.EncodeToString(raw) + compact[strings.Index(compact, "."):]
}

// withPart returns compact with part i replaced by s.
func withPart(compact string, i int, s string) string {
	p := strings.Split(compact, ".")
	p[i] = s
	return strings.Join(p, ".")
}

func b64(b []byte) string { return base64.RawURLEncoding.EncodeToString(b) }

// R4.2: seals made by go-jose (bcd's side, Seal) open with Open, for many
// tokens of every length, and to keys of their own.
func TestSealOpenInterop(t *testing.T) {
	csr := newCSR(t, newP256(t))
	req := requestFor(csr, "a")
	for i := 0; i < 200; i++ {
		key := newP256(t)
		n := 1 + i*pki.MaxSealedTokenSize/200
		if i == 199 {
			n = pki.MaxSealedTokenSize
		}
		buf := make([]byte, n)
		rand.Read(buf)
		tok := strings.ToValidUTF8(b64(buf)[:n], "x")
		if i%3 == 0 {
			tok = strings.Repeat("é", n/2) + strings.Repeat("a", n%2) // multi-byte UTF-8
		}
		if !utf8.ValidString(tok) || len(tok) != n {
			t.Fatalf("bad test token of %d bytes", len(tok))
		}
		sealed, err := pki.Seal(&key.PublicKey, tok, csr, req, t0)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Open(key, sealed, csr, req, t0)
		if err != nil || got != tok {
			t.Fatalf("token of %d bytes: Open = %q, %v", n, got, err)
		}
		o, err := NewSealOpener(key)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := o.Open(sealed, csr, req, t0); err != nil || got != tok {
			t.Fatalf("token of %d bytes: SealOpener.Open = %q, %v", n, got, err)
		}
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	for name, k := range map[string]*ecdsa.PrivateKey{"nil": nil, "P-384": p384} {
		if _, err := NewSealOpener(k); err == nil {
			t.Errorf("NewSealOpener took a %s key", name)
		}
	}
}

// R4.2: every part of a seal is authenticated or checked; a change to any
// is refused with the reason the server records.
func TestOpenTampered(t *testing.T) {
	key := newP256(t)
	csr := newCSR(t, newP256(t))
	req := requestFor(csr, "a")
	good, err := pki.Seal(&key.PublicKey, testToken, csr, req, t0)
	if err != nil {
		t.Fatal(err)
	}
	opener, err := NewSealOpener(key)
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(good, ".")
	flip := func(i, at int) string {
		b, err := base64.RawURLEncoding.DecodeString(parts[i])
		if err != nil {
			t.Fatal(err)
		}
		b[at%len(b)] ^= 0x80
		return withPart(good, i, b64(b))
	}
	resize := func(i, n int) string {
		b, _ := base64.RawURLEncoding.DecodeString(parts[i])
		if n < 0 {
			b = b[:len(b)+n]
		} else {
			b = append(b, make([]byte, n)...)
		}
		return withPart(good, i, b64(b))
	}
	epk := func(edit func(e map[string]any)) string {
		return reheader(t, good, func(h map[string]any) {
			e := h["epk"].(map[string]any)
			edit(e)
		})
	}
	p384, _ := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	p384X, p384Y := p384.X.FillBytes(make([]byte, 48)), p384.Y.FillBytes(make([]byte, 48))
	x25519, _ := ecdh.X25519().GenerateKey(rand.Reader)
	epkX := func() []byte {
		b, _ := base64.RawURLEncoding.DecodeString(protectedHeader(t, good)["epk"].(map[string]any)["x"].(string))
		return b
	}()
	epkY := func() []byte {
		b, _ := base64.RawURLEncoding.DecodeString(protectedHeader(t, good)["epk"].(map[string]any)["y"].(string))
		return b
	}()
	offY := append([]byte(nil), epkY...)
	offY[31] ^= 1

	tests := []struct {
		name   string
		seal   string
		reason string
	}{
		{"encrypted key, first byte", flip(1, 0), ReasonSealDecrypt},
		{"encrypted key, last byte", flip(1, 39), ReasonSealDecrypt},
		{"encrypted key, 8 bytes short", resize(1, -8), ReasonSealDecrypt},
		{"encrypted key, 8 bytes long", resize(1, 8), ReasonSealDecrypt},
		{"encrypted key, 1 byte short", resize(1, -1), ReasonSealDecrypt},
		{"encrypted key, empty", withPart(good, 1, ""), ReasonSealDecrypt},
		{"IV", flip(2, 0), ReasonSealDecrypt},
		{"IV, last byte", flip(2, 11), ReasonSealDecrypt},
		{"IV, 1 byte short", resize(2, -1), ReasonSealDecrypt},
		{"IV, 4 bytes long", resize(2, 4), ReasonSealDecrypt},
		{"IV, empty", withPart(good, 2, ""), ReasonSealDecrypt},
		{"ciphertext, last byte", flip(3, len(testToken)-1), ReasonSealDecrypt},
		{"ciphertext, 1 byte short", resize(3, -1), ReasonSealDecrypt},
		{"ciphertext, 1 byte long", resize(3, 1), ReasonSealDecrypt},
		{"ciphertext, empty", withPart(good, 3, ""), ReasonSealDecrypt},
		{"tag, last byte", flip(4, 15), ReasonSealDecrypt},
		{"tag, 1 byte short", resize(4, -1), ReasonSealDecrypt},
		{"tag, 1 byte long", resize(4, 1), ReasonSealDecrypt},
		{"tag, empty", withPart(good, 4, ""), ReasonSealDecrypt},
		{"encrypted key not base64url", withPart(good, 1, parts[1][:len(parts[1])-1]+"+"), ReasonSealMalformed},
		{"IV padded", withPart(good, 2, parts[2]+"="), ReasonSealMalformed},
		{"ciphertext not base64url", withPart(good, 3, "*"+parts[3]), ReasonSealMalformed},
		{"tag with a newline", withPart(good, 4, parts[4][:4]+"\n"+parts[4][4:]), ReasonSealMalformed},
		{"epk x changed", epk(func(e map[string]any) { e["x"] = b64(offY) }), ReasonSealDecrypt},
		{"epk off the curve", epk(func(e map[string]any) { e["y"] = b64(offY) }), ReasonSealDecrypt},
		{"epk on P-384", epk(func(e map[string]any) { e["crv"] = "P-384"; e["x"] = b64(p384X); e["y"] = b64(p384Y) }), ReasonSealDecrypt},
		{"epk P-256 point labelled P-384", epk(func(e map[string]any) { e["crv"] = "P-384" }), ReasonSealDecrypt},
		{"epk X25519", epk(func(e map[string]any) {
			e["kty"] = "OKP"
			e["crv"] = "X25519"
			e["x"] = b64(x25519.PublicKey().Bytes())
			delete(e, "y")
		}), ReasonSealDecrypt},
		{"epk without y", epk(func(e map[string]any) { delete(e, "y") }), ReasonSealDecrypt},
		{"epk x short", epk(func(e map[string]any) { e["x"] = b64(epkX[1:]) }), ReasonSealDecrypt},
		{"epk x padded", epk(func(e map[string]any) { e["x"] = b64(append([]byte{0}, epkX...)) }), ReasonSealDecrypt},
		{"epk kty RSA", epk(func(e map[string]any) { e["kty"] = "RSA" }), ReasonSealDecrypt},
		{"epk not an object", reheader(t, good, func(h map[string]any) { h["epk"] = "x" }), ReasonSealDecrypt},
		{"epk null", reheader(t, good, func(h map[string]any) { h["epk"] = nil }), ReasonSealDecrypt},
		{"no epk", reheader(t, good, func(h map[string]any) { delete(h, "epk") }), ReasonSealDecrypt},
		{"epk with a private key", epk(func(e map[string]any) { e["d"] = b64(make([]byte, 32)) }), ReasonSealDecrypt},
		{"apu", reheader(t, good, func(h map[string]any) { h["apu"] = b64([]byte("alice")) }), ReasonSealHeader},
		{"apv", reheader(t, good, func(h map[string]any) { h["apv"] = b64([]byte("bob")) }), ReasonSealHeader},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok, err := Open(key, tt.seal, csr, req, t0)
			reason, ok := SealReason(err)
			if !ok || reason != tt.reason || tok != "" {
				t.Errorf("Open = %q, %v; want reason %s", tok, err, tt.reason)
			}
			tok, err = opener.Open(tt.seal, csr, req, t0)
			if reason2, _ := SealReason(err); reason2 != tt.reason || tok != "" {
				t.Errorf("SealOpener.Open = %q, %v; want reason %s", tok, err, tt.reason)
			}
		})
	}

}
