package secret

import (
	"encoding/base64"
	"strings"
	"testing"
)

// b64url is the base64url alphabet, in value order.
const b64url = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

// otherLast returns plain with its last character replaced by another
// canonical one (a multiple of 4 in value: the low 2 bits are padding), so
// the result is a different well-formed secret.
func otherLast(plain string) string {
	last := strings.IndexByte(b64url, plain[len(plain)-1])
	return plain[:len(plain)-1] + string(b64url[(last+4)%64])
}

// R2.1: 256 random bits, base64url, only the SHA-256 kept. The
// tampered secret never equals the original: replacing the last character
// with "A" would leave it unchanged once in 16 mints (it carries 4 bits).
func TestMintParseMatch(t *testing.T) {
	for range 200 { // covers each of the 16 last characters many times
		plain, sum := Mint()
		raw, err := base64.RawURLEncoding.Strict().DecodeString(plain)
		if err != nil || len(raw) != 32 {
			t.Fatalf("secret %q is not 256 bits of canonical base64url", plain)
		}
		bearer := Format("bcjt", "jt_01k5w0000000000000000000aa", plain)
		id, got, ok := Parse("bcjt", bearer)
		if !ok || id != "jt_01k5w0000000000000000000aa" || got != plain {
			t.Fatalf("Parse(%q) = %q %q %v", bearer, id, got, ok)
		}
		other := otherLast(plain)
		if other == plain {
			t.Fatalf("otherLast(%q) did not change it", plain)
		}
		if _, _, ok := Parse("bcjt", Format("bcjt", "jt_x", other)); !ok {
			t.Fatalf("Parse refused the canonical secret %q", other)
		}
		if !Matches(plain, sum) || Matches(other, sum) {
			t.Fatalf("Matches is wrong for %q / %q", plain, other)
		}
		if strings.Contains(string(sum), plain) {
			t.Fatal("hash contains the secret")
		}
	}
}

// R2.1: a secret has one spelling. The last character's 2 low bits are
// padding; a non-canonical spelling (padding bits set) of a minted secret
// is refused by Parse instead of reaching the hash comparison.
func TestParseRefusesNonCanonical(t *testing.T) {
	plain, _ := Mint()
	last := strings.IndexByte(b64url, plain[len(plain)-1])
	for pad := 1; pad < 4; pad++ {
		alias := plain[:len(plain)-1] + string(b64url[last|pad])
		if raw, err := base64.RawURLEncoding.DecodeString(alias); err != nil || len(raw) != 32 {
			t.Fatalf("alias %q should decode leniently to 32 bytes", alias)
		}
		if _, _, ok := Parse("bcjt", "bcjt_jt_x."+alias); ok {
			t.Errorf("Parse accepted the non-canonical spelling %q of %q", alias, plain)
		}
	}
}

func TestParseRejects(t *testing.T) {
	plain, _ := Mint()
	for _, in := range []string{
		"", "bcjt_", "bcjt_jt_x", "bck_jt_x." + plain, "bcjt_." + plain,
		"bcjt_jt_x." + plain[:40], "bcjt_jt_x." + plain + "AA", "bcjt_jt_x." + plain[:42] + "*",
	} {
		if _, _, ok := Parse("bcjt", in); ok {
			t.Errorf("Parse(%q) accepted", in)
		}
	}
}
