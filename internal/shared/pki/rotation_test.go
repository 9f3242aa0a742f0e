package pki

import (
	"crypto/ecdsa"
	"crypto/x509"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func keySPKI(t testing.TB, k *ecdsa.PrivateKey) []byte {
	t.Helper()
	der, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func pinOfKey(t testing.TB, k *ecdsa.PrivateKey) string {
	t.Helper()
	return PinSPKI(keySPKI(t, k))
}

// statement is an encoded statement of kind: signer says action about
// subject.
func statement(t testing.TB, kind, action string, signer, subject *ecdsa.PrivateKey) string {
	t.Helper()
	enc, err := SignKeyStatement(signer, KeyStatement{Kind: kind, Action: action, Signer: keySPKI(t, signer), Subject: keySPKI(t, subject), IssuedAt: t0})
	if err != nil {
		t.Fatal(err)
	}
	return enc
}

// R16.2: a statement counts only when a pinned key signed it; chains are
// followed; a retire needs another pinned key.
func TestApplyStatements(t *testing.T) {
	k1, k2, k3, stranger := newP256(t), newP256(t), newP256(t), newP256(t)
	p1, p2, p3 := pinOfKey(t, k1), pinOfKey(t, k2), pinOfKey(t, k3)
	trust := func(signer, subject *ecdsa.PrivateKey) string {
		return statement(t, KindServingCA, ActionTrust, signer, subject)
	}
	retire := func(signer, subject *ecdsa.PrivateKey) string {
		return statement(t, KindServingCA, ActionRetire, signer, subject)
	}
	tampered := func() string {
		s := trust(k1, k2)
		body, sig, _ := strings.Cut(s, ".")
		return body + "." + strings.Repeat("A", len(sig))
	}
	tests := []struct {
		name        string
		pins        []string
		retired     []string
		statements  []string
		want        []string
		wantAdded   []string
		wantRetired []string
		wantDropped []string
	}{
		{name: "none", pins: []string{p1}, want: []string{p1}},
		{name: "trusted by a pinned key", pins: []string{p1}, statements: []string{trust(k1, k2)}, want: []string{p1, p2}, wantAdded: []string{p2}},
		{name: "signed by an unpinned key", pins: []string{p1}, statements: []string{trust(stranger, k2)}, want: []string{p1}},
		{name: "the stranger vouches for itself through another", pins: []string{p1}, statements: []string{trust(stranger, k2), trust(k2, stranger)}, want: []string{p1}},
		{name: "another kind is skipped", pins: []string{p1}, statements: []string{statement(t, KindJoinSigning, ActionTrust, k1, k2)}, want: []string{p1}},
		{name: "chain of three followed, in any order", pins: []string{p1}, statements: []string{trust(k2, k3), trust(k1, k2)}, want: []string{p1, p2, p3}, wantAdded: []string{p2, p3}},
		{name: "retire by the next key", pins: []string{p1, p2}, statements: []string{retire(k2, k1)}, want: []string{p2}, wantRetired: []string{p1}},
		{name: "trust then retire the old key", pins: []string{p1}, statements: []string{trust(k1, k2), retire(k2, k1)}, want: []string{p2}, wantAdded: []string{p2}, wantRetired: []string{p1}},
		{name: "a retired key cannot vouch", pins: []string{p1, p2}, statements: []string{retire(k2, k1), trust(k1, k3)}, want: []string{p2}, wantRetired: []string{p1}},
		{name: "a retired key is not trusted again", pins: []string{p1, p2}, statements: []string{retire(k2, k1), trust(k2, k1)}, want: []string{p2}, wantRetired: []string{p1}},
		{name: "retire by an unpinned key", pins: []string{p1}, statements: []string{retire(stranger, k1)}, want: []string{p1}},
		// R21.3: pins only move forward.
		{name: "a rolled-back key is not pinned again", pins: []string{p1}, retired: []string{p2}, statements: []string{trust(k1, k2)}, want: []string{p1}},
		{name: "trust then rollback in one answer changes no pin", pins: []string{p1}, statements: []string{trust(k1, k2), retire(k1, k2)}, want: []string{p1}, wantDropped: []string{p2}},
		{name: "rollback then replayed trust changes no pin", pins: []string{p1}, statements: []string{retire(k1, k2), trust(k1, k2)}, want: []string{p1}, wantDropped: []string{p2}},
		{name: "a retirement already known is not news", pins: []string{p1}, retired: []string{p2}, statements: []string{trust(k1, k2), retire(k1, k2)}, want: []string{p1}},
		{name: "a pin known retired is dropped", pins: []string{p1, p2}, retired: []string{p1}, want: []string{p2}, wantRetired: []string{p1}},
		{name: "the last pin is kept though known retired", pins: []string{p1}, retired: []string{p1}, want: []string{p1}},
		{name: "two keys retiring each other never empty the set", pins: []string{p1, p2}, statements: []string{retire(k2, k1), retire(k1, k2)}, want: []string{p2}, wantRetired: []string{p1}, wantDropped: []string{p1}},
		{name: "garbage is skipped", pins: []string{p1}, statements: []string{"", "x.y", "not a statement", tampered(), trust(k1, k2)}, want: []string{p1, p2}, wantAdded: []string{p2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.pins)
			got, change := ApplyStatements(KindServingCA, tt.pins, tt.retired, tt.statements)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("pins (-want +got):\n%s", diff)
			}
			if !slices.Equal(in, tt.pins) {
				t.Errorf("the input pins were changed: %v", tt.pins)
			}
			if diff := cmp.Diff(tt.wantAdded, change.Added, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("added (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantRetired, change.Retired, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("retired (-want +got):\n%s", diff)
			}
			wantDropped := tt.wantDropped
			if wantDropped == nil {
				// A retire statement a pinned key signed is news unless
				// its key was known retired already.
				wantDropped = slices.DeleteFunc(slices.Clone(tt.wantRetired), func(p string) bool { return slices.Contains(tt.retired, p) })
			}
			if diff := cmp.Diff(wantDropped, change.Dropped, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("dropped (-want +got):\n%s", diff)
			}
			if change.Changed() != (len(tt.wantAdded)+len(tt.wantRetired) > 0) {
				t.Errorf("Changed() = %v", change.Changed())
			}
			for _, p := range change.Added {
				if k := change.Keys[p]; k == nil || !PinMatches(p, k) {
					t.Errorf("no key for added pin %s", p)
				}
			}
		})
	}
}

// R16.2: a key never speaks of itself, and statements are signed by their
// signer.
func TestSignKeyStatementRefuses(t *testing.T) {
	k1, k2 := newP256(t), newP256(t)
	tests := []struct {
		name   string
		signer *ecdsa.PrivateKey
		st     KeyStatement
	}{
		{name: "self statement", signer: k1, st: KeyStatement{Kind: KindServingCA, Action: ActionTrust, Signer: keySPKI(t, k1), Subject: keySPKI(t, k1)}},
		{name: "unknown kind", signer: k1, st: KeyStatement{Kind: "node-ca", Action: ActionTrust, Signer: keySPKI(t, k1), Subject: keySPKI(t, k2)}},
		{name: "unknown action", signer: k1, st: KeyStatement{Kind: KindServingCA, Action: "revoke", Signer: keySPKI(t, k1), Subject: keySPKI(t, k2)}},
		{name: "signed by another key", signer: k2, st: KeyStatement{Kind: KindServingCA, Action: ActionTrust, Signer: keySPKI(t, k1), Subject: keySPKI(t, k2)}},
		{name: "subject not a key", signer: k1, st: KeyStatement{Kind: KindServingCA, Action: ActionTrust, Signer: keySPKI(t, k1), Subject: []byte("x")}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := SignKeyStatement(tt.signer, tt.st); err == nil {
				t.Fatal("signed")
			}
		})
	}
}

// R16.2: a parsed statement says what was signed; one that was altered does
// not parse.
func TestParseKeyStatement(t *testing.T) {
	k1, k2 := newP256(t), newP256(t)
	enc := statement(t, KindJoinEncryption, ActionRetire, k1, k2)
	st, err := ParseKeyStatement(enc)
	if err != nil {
		t.Fatal(err)
	}
	if st.Kind != KindJoinEncryption || st.Action != ActionRetire || PinSPKI(st.Subject) != pinOfKey(t, k2) || !st.IssuedAt.Equal(t0) {
		t.Errorf("parsed %+v", st)
	}
	body, sig, _ := strings.Cut(enc, ".")
	other := statement(t, KindJoinEncryption, ActionTrust, k1, k2)
	otherBody, _, _ := strings.Cut(other, ".")
	for name, s := range map[string]string{
		"body swapped": otherBody + "." + sig,
		"too large":    strings.Repeat("A", maxStatementSize+1),
		"no dot":       body,
	} {
		if _, err := ParseKeyStatement(s); err == nil {
			t.Errorf("%s: parsed", name)
		}
	}
}

// R16.2: MaxKeyStatements bounds the work one answer can cause.
func TestApplyStatementsBounded(t *testing.T) {
	k1, k2 := newP256(t), newP256(t)
	junk := slices.Repeat([]string{"junk"}, MaxKeyStatements)
	got, _ := ApplyStatements(KindServingCA, []string{pinOfKey(t, k1)}, nil, append(junk, statement(t, KindServingCA, ActionTrust, k1, k2)))
	if len(got) != 1 {
		t.Errorf("a statement past the bound counted: %v", got)
	}
}
