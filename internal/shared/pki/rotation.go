package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Kinds of key a daemon pins (R16.2). A rotation statement names one; a key
// of one kind never vouches for a key of another.
const (
	KindServingCA      = "serving-ca"
	KindJoinSigning    = "join-signing"
	KindJoinEncryption = "join-encryption"
)

// Statement actions.
const (
	// ActionTrust: the signer vouches for Subject, the next key of its kind.
	ActionTrust = "trust"
	// ActionRetire: the signer says Subject, another key of its kind, is no
	// longer accepted (the rotation's retire phase, or a rollback dropping
	// a key that was prepared).
	ActionRetire = "retire"
)

// PurposeKeyStatement signs rotation statements.
const PurposeKeyStatement = "key-statement"

// maxStatementSize bounds one encoded statement; a real one is under 600
// bytes.
const maxStatementSize = 4 << 10

// MaxKeyStatements bounds how many statements one answer may carry.
const MaxKeyStatements = 64

// KeyStatement is what one key of a kind says about another of the same
// kind (R16.2). Keys are SubjectPublicKeyInfo DER: the daemon holds only
// pins, so the statement carries the signer's key for the daemon to check
// it against a pin and verify the signature with it.
type KeyStatement struct {
	Kind     string    `json:"kind"`
	Action   string    `json:"action"`
	Signer   []byte    `json:"signer"`
	Subject  []byte    `json:"subject"`
	IssuedAt time.Time `json:"issuedAt"`
}

// SignKeyStatement signs st with key (whose public key must be st.Signer)
// and returns the encoded statement: base64url(body) "." base64url(sig).
func SignKeyStatement(key crypto.Signer, st KeyStatement) (string, error) {
	if err := st.check(); err != nil {
		return "", err
	}
	spki, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil || string(spki) != string(st.Signer) {
		return "", errors.New("sign key statement: the key is not the statement's signer")
	}
	body, err := json.Marshal(st)
	if err != nil {
		return "", fmt.Errorf("marshal key statement: %w", err)
	}
	sig, err := SignPurpose(key, PurposeKeyStatement, body)
	if err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(body) + "." + base64.RawURLEncoding.EncodeToString(sig), nil
}

// ParseKeyStatement decodes an encoded statement and verifies its signature
// under its own Signer key. It says nothing of whether that key is trusted:
// ApplyStatements decides that against pins.
func ParseKeyStatement(enc string) (KeyStatement, error) {
	var st KeyStatement
	if len(enc) > maxStatementSize {
		return st, errors.New("key statement: too large")
	}
	b64body, b64sig, ok := strings.Cut(enc, ".")
	if !ok {
		return st, errors.New("key statement: not body.signature")
	}
	body, err1 := base64.RawURLEncoding.DecodeString(b64body)
	sig, err2 := base64.RawURLEncoding.DecodeString(b64sig)
	if err1 != nil || err2 != nil {
		return st, errors.New("key statement: not base64url")
	}
	if err := json.Unmarshal(body, &st); err != nil {
		return st, errors.New("key statement: not JSON")
	}
	if err := st.check(); err != nil {
		return st, err
	}
	signer, err := ParseP256SPKI(st.Signer)
	if err != nil {
		return st, err
	}
	if err := VerifyPurpose(signer, PurposeKeyStatement, body, sig); err != nil {
		return st, fmt.Errorf("key statement: %w", err)
	}
	return st, nil
}

func (st KeyStatement) check() error {
	switch st.Kind {
	case KindServingCA, KindJoinSigning, KindJoinEncryption:
	default:
		return fmt.Errorf("key statement: unknown kind %q", st.Kind)
	}
	if st.Action != ActionTrust && st.Action != ActionRetire {
		return fmt.Errorf("key statement: unknown action %q", st.Action)
	}
	if _, err := ParseP256SPKI(st.Signer); err != nil {
		return err
	}
	if _, err := ParseP256SPKI(st.Subject); err != nil {
		return err
	}
	if string(st.Signer) == string(st.Subject) {
		return errors.New("key statement: a key cannot speak of itself")
	}
	return nil
}

// ParseP256SPKI parses a DER SubjectPublicKeyInfo holding an ECDSA P-256 key.
func ParseP256SPKI(der []byte) (*ecdsa.PublicKey, error) {
	pub, err := x509.ParsePKIXPublicKey(der)
	if err != nil {
		return nil, errors.New("key statement: not a public key")
	}
	k, ok := pub.(*ecdsa.PublicKey)
	if !ok || !IsP256(k) {
		return nil, errors.New("key statement: not an ECDSA P-256 key")
	}
	return k, nil
}

// PinChange is what ApplyStatements did to one kind's pins.
type PinChange struct {
	Kind string
	// Added and Retired are the pins the set gained and lost. A key both
	// vouched for and retired by the same statements is in neither: the
	// set did not change for it.
	Added   []string
	Retired []string
	// Dropped are the keys a pinned key said are retired (a retire phase
	// or a rollback) that were not known retired before, pinned or not:
	// the daemon keeps them so that no later statement pins them again
	// (R21.3).
	Dropped []string
	// Keys holds the public key of every added pin (the daemon needs the
	// join-encryption key itself, not only its pin).
	Keys map[string]*ecdsa.PublicKey
}

// ApplyStatements returns pins (one kind's pin set, oldest first) after the
// statements of that kind that a pinned key signed, and what changed.
// retired lists the keys already known retired (of any kind): they are
// never pinned again, and a pin among them is dropped (a crash between the
// two writes that record a retirement), unless it is the set's last.
//
// SECURITY (R16.2, R21.3): a statement counts only when its signer's key
// hashes to a pin already in the set, so neither a relay nor the network
// can add a key; a key the set gains may then vouch for the next one,
// which is how a daemon offline through several rotations follows the
// chain. A retire statement removes its subject only when signed by
// another pinned key and never empties the set, and a retired key can no
// longer vouch. Pins only move forward: a key once seen retired (in
// retired, or retired by these statements) is never added, so replaying
// an old "trust" statement after its key was retired or rolled back gains
// nothing. Statements that do not verify, are of another kind, or name
// unknown signers are skipped (the answer carrying them may still be
// good). The result keeps the order keys were learned in: the last is the
// newest.
func ApplyStatements(kind string, pins, retired []string, statements []string) ([]string, PinChange) {
	change := PinChange{Kind: kind, Keys: map[string]*ecdsa.PublicKey{}}
	known := map[string]bool{}
	for _, p := range retired {
		known[p] = true
	}
	set := slices.DeleteFunc(slices.Clone(pins), func(p string) bool { return known[p] })
	if len(set) == 0 {
		set = slices.Clone(pins)
	}
	parsed := parseKind(kind, statements)
	dropped := map[string]bool{}
	// A fixpoint: each round may pin a key that signs the next statement.
	for progress := true; progress; {
		progress = false
		for _, st := range parsed {
			signer, subject := PinSPKI(st.Signer), PinSPKI(st.Subject)
			if !slices.Contains(set, signer) {
				continue
			}
			switch st.Action {
			case ActionTrust:
				if slices.Contains(set, subject) || known[subject] || dropped[subject] {
					continue
				}
				set = append(set, subject)
				change.Keys[subject], _ = ParseP256SPKI(st.Subject)
				progress = true
			case ActionRetire:
				if !dropped[subject] && !known[subject] {
					dropped[subject] = true
					change.Dropped = append(change.Dropped, subject)
					progress = true
				}
				if slices.Contains(set, subject) && len(set) > 1 {
					set = slices.DeleteFunc(set, func(p string) bool { return p == subject })
					progress = true
				}
			}
		}
	}
	for _, p := range set {
		if !slices.Contains(pins, p) {
			change.Added = append(change.Added, p)
		}
	}
	for _, p := range pins {
		if !slices.Contains(set, p) {
			change.Retired = append(change.Retired, p)
		}
	}
	for p := range change.Keys {
		if !slices.Contains(change.Added, p) {
			delete(change.Keys, p)
		}
	}
	return set, change
}

// parseKind returns the statements of kind that verify under their own
// signer, at most MaxKeyStatements of them looked at.
func parseKind(kind string, statements []string) []KeyStatement {
	var parsed []KeyStatement
	for i, enc := range statements {
		if i >= MaxKeyStatements {
			break
		}
		st, err := ParseKeyStatement(enc)
		if err == nil && st.Kind == kind {
			parsed = append(parsed, st)
		}
	}
	return parsed
}

// Changed reports whether the set changed.
func (c PinChange) Changed() bool { return len(c.Added) > 0 || len(c.Retired) > 0 }

// Learned reports whether there is anything to keep: the set changed, or
// a key was newly seen retired.
func (c PinChange) Learned() bool { return c.Changed() || len(c.Dropped) > 0 }

// PinIn reports whether pub hashes to one of pins (each compared in
// constant time).
func PinIn(pins []string, pub crypto.PublicKey) bool {
	found := false
	for _, p := range pins {
		if PinMatches(p, pub) {
			found = true
		}
	}
	return found
}
