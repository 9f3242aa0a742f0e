package bcdconfig

import (
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig/bcdconfigtest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R16.2: the effective set is the array plus the singular key; setting it
// keeps the singular on the newest pin, and the array only while there are
// two or more.
func TestPinSet(t *testing.T) {
	a, b, c := bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t)), bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t)), bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t))
	tests := []struct {
		name   string
		single string
		set    []string
		want   []string
	}{
		{name: "singular only", single: a, want: []string{a}},
		{name: "array holds the singular", single: b, set: []string{a, b}, want: []string{a, b}},
		{name: "singular newer than the array", single: c, set: []string{a, b}, want: []string{a, b, c}},
		{name: "array only", set: []string{a, b}, want: []string{a, b}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, kind := range PinKinds() {
				var cfg Config
				single, set := cfg.pinFields(kind)
				*single, *set = tt.single, tt.set
				if diff := cmp.Diff(tt.want, cfg.PinSet(kind)); diff != "" {
					t.Errorf("%s (-want +got):\n%s", kind, diff)
				}
			}
		})
	}
	var cfg Config
	cfg.SetPinSet(pki.KindJoinSigning, []string{a, b})
	if cfg.JoinSigningKeyPin != b || !slices.Equal(cfg.JoinSigningKeyPins, []string{a, b}) {
		t.Errorf("set of two: singular %s, array %v", cfg.JoinSigningKeyPin, cfg.JoinSigningKeyPins)
	}
	cfg.SetPinSet(pki.KindJoinSigning, []string{b})
	if cfg.JoinSigningKeyPin != b || cfg.JoinSigningKeyPins != nil {
		t.Errorf("set of one: singular %s, array %v (an older bcd refuses the array key)", cfg.JoinSigningKeyPin, cfg.JoinSigningKeyPins)
	}
	if cfg.PinSet("node-ca") != nil {
		t.Error("an unknown kind has pins")
	}
}

// R16.2: every entry of a set is a pin, and a set may stand for its
// singular key.
func TestValidatePinSets(t *testing.T) {
	f := bcdconfigtest.New(t)
	other := bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t))
	if _, err := Parse([]byte(f.TOML(`serving_ca_spki_pins = ["` + other + `", "` + f.CAPin + `"]`))); err != nil {
		t.Errorf("two serving CA pins: %v", err)
	}
	_, err := Parse([]byte(f.TOML(`join_signing_key_pins = ["` + other + `", "sha256/nope"]`)))
	if e, ok := errs.As(err); !ok || e.Code != errs.InvalidConfig || !strings.Contains(e.Message, "join_signing_key_pins[1]: want sha256/") {
		t.Errorf("a bad entry: %v", err)
	}
	noSingle := strings.Replace(f.TOML(`join_encryption_key_pins = ["`+other+`", "`+f.EncPin+`"]`), `join_encryption_key_pin = "`+f.EncPin+`"`, "", 1)
	c, err := Parse([]byte(noSingle))
	if err != nil {
		t.Fatalf("array without the singular: %v", err)
	}
	if diff := cmp.Diff([]string{other, f.EncPin}, c.JoinEncryptionPins()); diff != "" {
		t.Errorf("set (-want +got):\n%s", diff)
	}
	noPins := strings.Replace(f.TOML(""), `join_encryption_key_pin = "`+f.EncPin+`"`, "", 1)
	if _, err := Parse([]byte(noPins)); err == nil || !strings.Contains(err.Error(), "join_encryption_key_pin: required") {
		t.Errorf("no encryption pin at all: %v", err)
	}
}

// R16.2: the loader accepts a jwk matching any pin of the set, and refuses
// one matching none.
func TestLoadEncryptionKeySet(t *testing.T) {
	dir := t.TempDir()
	k1, k2 := bcdconfigtest.NewKey(t), bcdconfigtest.NewKey(t)
	p1, p2, p3 := bcdconfigtest.PinOf(t, k1), bcdconfigtest.PinOf(t, k2), bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t))
	if _, _, found, err := LoadEncryptionKeySet(dir, []string{p1}); found || err != nil {
		t.Errorf("missing file: found %v, err %v", found, err)
	}
	if err := WriteEncryptionKey(dir, p2, &k2.PublicKey); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		name    string
		pins    []string
		wantPin string
	}{
		{name: "the newest", pins: []string{p1, p2}, wantPin: p2},
		{name: "an older one", pins: []string{p2, p3}, wantPin: p2},
		{name: "none", pins: []string{p1, p3}},
	} {
		key, pin, found, err := LoadEncryptionKeySet(dir, tt.pins)
		switch {
		case !found:
			t.Errorf("%s: not found", tt.name)
		case tt.wantPin == "" && (err == nil || errs.CodeOf(err) != errs.InvalidConfig || !strings.Contains(err.Error(), "does not match")):
			t.Errorf("%s: err %v", tt.name, err)
		case tt.wantPin != "" && (err != nil || pin != tt.wantPin || !key.Equal(&k2.PublicKey)):
			t.Errorf("%s: pin %s, err %v", tt.name, pin, err)
		}
	}
	if _, _, _, err := LoadEncryptionKeySet(dir, []string{"sha256/x"}); err == nil {
		t.Error("a bad pin accepted")
	}
}
