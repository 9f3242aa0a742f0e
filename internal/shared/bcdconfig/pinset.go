package bcdconfig

import (
	"slices"

	"github.com/BurntSushi/toml"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// PinKinds lists the kinds of key bcd pins, in the order logs and bcd
// doctor name them.
func PinKinds() []string {
	return []string{pki.KindServingCA, pki.KindJoinSigning, pki.KindJoinEncryption}
}

// PinSet returns the effective pin set of kind (pki.KindServingCA,
// KindJoinSigning or KindJoinEncryption), oldest first: the array key, then
// the singular key when the array lacks it (an install that wrote only the
// singular, or an operator who replaced it by hand, names the newest key).
// An unknown kind has no pins.
func (c *Config) PinSet(kind string) []string {
	single, set := c.pinFields(kind)
	if single == nil {
		return nil
	}
	out := slices.Clone(*set)
	if *single != "" && !slices.Contains(out, *single) {
		out = append(out, *single)
	}
	return out
}

// ServingCAPins, JoinSigningPins and JoinEncryptionPins are PinSet of each
// kind.
func (c *Config) ServingCAPins() []string      { return c.PinSet(pki.KindServingCA) }
func (c *Config) JoinSigningPins() []string    { return c.PinSet(pki.KindJoinSigning) }
func (c *Config) JoinEncryptionPins() []string { return c.PinSet(pki.KindJoinEncryption) }

// SetPinSet replaces kind's pin set (oldest first, not empty). The singular
// key becomes the newest pin, so an older bcd that reads only it uses the
// newest key; the array is written only while the set holds more than one
// pin, so a config.toml whose rotation is over reads in an older bcd too
// (it refuses unknown keys).
func (c *Config) SetPinSet(kind string, pins []string) {
	single, set := c.pinFields(kind)
	if single == nil || len(pins) == 0 {
		return
	}
	*single = pins[len(pins)-1]
	*set = nil
	if len(pins) > 1 {
		*set = slices.Clone(pins)
	}
}

func (c *Config) pinFields(kind string) (*string, *[]string) {
	switch kind {
	case pki.KindServingCA:
		return &c.ServingCASPKIPin, &c.ServingCASPKIPins
	case pki.KindJoinSigning:
		return &c.JoinSigningKeyPin, &c.JoinSigningKeyPins
	case pki.KindJoinEncryption:
		return &c.JoinEncryptionKeyPin, &c.JoinEncryptionKeyPins
	}
	return nil, nil
}

// Newest returns the last pin of pins, "" when there is none.
func Newest(pins []string) string {
	if len(pins) == 0 {
		return ""
	}
	return pins[len(pins)-1]
}

// PinUpdate is what LearnStatements did: one pki.PinChange per kind that
// changed.
type PinUpdate struct {
	Changes []pki.PinChange
}

// Changed reports whether there is anything to save: a set changed, or a
// key was newly seen retired.
func (u PinUpdate) Changed() bool { return len(u.Changes) > 0 }

// PinsChanged reports whether a pin set changed (what is worth a log
// line).
func (u PinUpdate) PinsChanged() bool {
	for _, c := range u.Changes {
		if c.Changed() {
			return true
		}
	}
	return false
}

// Kind returns the change of kind, if it changed.
func (u PinUpdate) Kind(kind string) (pki.PinChange, bool) {
	for _, c := range u.Changes {
		if c.Kind == kind {
			return c, true
		}
	}
	return pki.PinChange{}, false
}

// MaxRetiredPins bounds RetiredPins: the oldest are forgotten first. Each
// rotation retires one key of a kind and a rollback one more, so this is
// dozens of rotations of every kind.
const MaxRetiredPins = 64

// ApplyStatements applies the rotation statements to c's pin sets in memory
// (pki.ApplyStatements per kind: only statements signed by a key c already
// pins count, and no key of RetiredPins is pinned again) and reports what
// changed; keys newly seen retired join RetiredPins. It writes nothing.
func (c *Config) ApplyStatements(statements []string) PinUpdate {
	var u PinUpdate
	for _, kind := range PinKinds() {
		next, change := pki.ApplyStatements(kind, c.PinSet(kind), c.RetiredPins, statements)
		if change.Changed() && len(next) > 0 {
			c.SetPinSet(kind, next)
		}
		if change.Learned() {
			c.addRetired(change.Dropped)
			u.Changes = append(u.Changes, change)
		}
	}
	return u
}

// addRetired appends pins to RetiredPins, keeping the newest
// MaxRetiredPins.
func (c *Config) addRetired(pins []string) {
	for _, p := range pins {
		if !slices.Contains(c.RetiredPins, p) {
			c.RetiredPins = append(c.RetiredPins, p)
		}
	}
	if n := len(c.RetiredPins); n > MaxRetiredPins {
		c.RetiredPins = slices.Clone(c.RetiredPins[n-MaxRetiredPins:])
	}
}

// LoadRaw reads config.toml without applying defaults, and validates it:
// what a writer that keeps the operator's file as it is starts from.
func LoadRaw(path string) (*Config, error) {
	data, err := readBounded(path, maxConfigSize)
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "cannot read the bcd config: %v", err)
	}
	var c Config
	md, err := toml.Decode(string(data), &c)
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "%s: not valid TOML: %v", path, err)
	}
	if len(md.Undecoded()) > 0 {
		return nil, errs.New(errs.InvalidConfig, "%s: unknown keys", path)
	}
	full := c
	full.ApplyDefaults()
	if err := full.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}
