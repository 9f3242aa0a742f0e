package secret

import (
	"encoding/base64"
	"strings"
	"testing"
)

// R2.1: 256 random bits, base64url, only the SHA-256 kept.
func TestMintParseMatch(t *testing.T) {
	plain, sum := Mint()
	raw, err := base64.RawURLEncoding.DecodeString(plain)
	if err != nil || len(raw) != 32 {
		t.Fatalf("secret %q is not 256 bits of base64url", plain)
	}
	bearer := Format("bcjt", "jt_01k5w0000000000000000000aa", plain)
	id, got, ok := Parse("bcjt", bearer)
	if !ok || id != "jt_01k5w0000000000000000000aa" || got != plain {
		t.Fatalf("Parse(%q) = %q %q %v", bearer, id, got, ok)
	}
	if !Matches(plain, sum) || Matches(plain[:42]+"A", sum) {
		t.Fatal("Matches is wrong")
	}
	if strings.Contains(string(sum), plain) {
		t.Fatal("hash contains the secret")
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
