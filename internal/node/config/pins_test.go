package config

import (
	"crypto/ecdsa"
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig/bcdconfigtest"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

func stmt(t *testing.T, kind, action string, signer, subject *ecdsa.PrivateKey) string {
	t.Helper()
	spki := func(k *ecdsa.PrivateKey) []byte {
		der, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
		if err != nil {
			t.Fatal(err)
		}
		return der
	}
	enc, err := pki.SignKeyStatement(signer, pki.KeyStatement{Kind: kind, Action: action, Signer: spki(signer), Subject: spki(subject), IssuedAt: time.Unix(1_700_000_000, 0)})
	if err != nil {
		t.Fatal(err)
	}
	return enc
}

// rotation is one install's keys (three generations of each kind) and its
// config.toml with the first generation pinned.
type rotation struct {
	dir, path  string
	ca, sg, en [3]*ecdsa.PrivateKey
}

func newRotation(t *testing.T) *rotation {
	r := &rotation{dir: t.TempDir()}
	r.path = filepath.Join(r.dir, "config.toml")
	for i := range 3 {
		r.ca[i], r.sg[i], r.en[i] = bcdconfigtest.NewKey(t), bcdconfigtest.NewKey(t), bcdconfigtest.NewKey(t)
	}
	f := bcdconfigtest.New(t)
	f.CAPin, f.SigPin, f.EncPin = bcdconfigtest.PinOf(t, r.ca[0]), bcdconfigtest.PinOf(t, r.sg[0]), bcdconfigtest.PinOf(t, r.en[0])
	if err := os.WriteFile(r.path, []byte(f.TOML(`data_dir = "/var/lib/bcd-test"`)), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := bcdconfig.WriteEncryptionKey(r.dir, f.EncPin, &r.en[0].PublicKey); err != nil {
		t.Fatal(err)
	}
	return r
}

// twoRotations is every kind rotated twice (0 vouches for 1, 1 for 2, then
// 0 and 1 retired by 2), as one answer carries them.
func (r *rotation) twoRotations(t *testing.T) []string {
	var out []string
	for _, k := range []struct {
		kind string
		keys [3]*ecdsa.PrivateKey
	}{{pki.KindServingCA, r.ca}, {pki.KindJoinSigning, r.sg}, {pki.KindJoinEncryption, r.en}} {
		out = append(out,
			stmt(t, k.kind, pki.ActionTrust, k.keys[0], k.keys[1]),
			stmt(t, k.kind, pki.ActionTrust, k.keys[1], k.keys[2]),
			stmt(t, k.kind, pki.ActionRetire, k.keys[2], k.keys[0]),
			stmt(t, k.kind, pki.ActionRetire, k.keys[2], k.keys[1]))
	}
	return out
}

// R16.2: statements no pinned key signed change nothing and write nothing.
func TestLearnStatementsRefusesUnpinned(t *testing.T) {
	r := newRotation(t)
	stranger := bcdconfigtest.NewKey(t)
	before, _ := os.ReadFile(r.path)
	jwkBefore, _ := os.ReadFile(filepath.Join(r.dir, bcdconfig.EncryptionKeyFile))
	injected := []string{
		stmt(t, pki.KindServingCA, pki.ActionTrust, stranger, r.ca[1]),
		stmt(t, pki.KindJoinSigning, pki.ActionTrust, stranger, r.sg[1]),
		stmt(t, pki.KindJoinEncryption, pki.ActionTrust, stranger, r.en[1]),
		stmt(t, pki.KindServingCA, pki.ActionRetire, stranger, r.ca[0]),
		// The right signer, the wrong kind.
		stmt(t, pki.KindJoinSigning, pki.ActionTrust, r.ca[0], r.ca[1]),
		"garbage",
	}
	_, u, err := LearnStatements(r.path, injected)
	if err != nil || u.Changed() {
		t.Fatalf("changed %v, err %v", u.Changes, err)
	}
	after, _ := os.ReadFile(r.path)
	jwkAfter, _ := os.ReadFile(filepath.Join(r.dir, bcdconfig.EncryptionKeyFile))
	if string(before) != string(after) || string(jwkBefore) != string(jwkAfter) {
		t.Error("files were written")
	}
}

// R16.2: a chain of two rotations of all three kinds in one answer: every
// set ends on the third key, the jwk holds the third encryption key, and
// the file keeps its own keys (no defaults written).
func TestLearnStatementsChain(t *testing.T) {
	r := newRotation(t)
	c, u, err := LearnStatements(r.path, r.twoRotations(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(u.Changes) != 3 {
		t.Errorf("changes %+v", u.Changes)
	}
	loaded, err := bcdconfig.Load(r.path)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []struct {
		kind string
		key  *ecdsa.PrivateKey
	}{{pki.KindServingCA, r.ca[2]}, {pki.KindJoinSigning, r.sg[2]}, {pki.KindJoinEncryption, r.en[2]}} {
		want := []string{bcdconfigtest.PinOf(t, k.key)}
		if diff := cmp.Diff(want, loaded.PinSet(k.kind)); diff != "" {
			t.Errorf("%s (-want +got):\n%s", k.kind, diff)
		}
		if diff := cmp.Diff(want, c.PinSet(k.kind)); diff != "" {
			t.Errorf("returned %s (-want +got):\n%s", k.kind, diff)
		}
	}
	if loaded.ServingCASPKIPin != bcdconfigtest.PinOf(t, r.ca[2]) {
		t.Errorf("singular serving_ca_spki_pin %s is not the newest", loaded.ServingCASPKIPin)
	}
	key, found, err := bcdconfig.LoadEncryptionKey(r.dir, loaded.JoinEncryptionKeyPin)
	if err != nil || !found || !key.Equal(&r.en[2].PublicKey) {
		t.Errorf("jwk: found %v, err %v", found, err)
	}
	raw, _ := os.ReadFile(r.path)
	if strings.Contains(string(raw), "sysfs_root") || !strings.Contains(string(raw), "/var/lib/bcd-test") {
		t.Errorf("the file lost its keys or gained defaults:\n%s", raw)
	}
	// The same answer again changes nothing.
	if _, u, err := LearnStatements(r.path, r.twoRotations(t)); err != nil || u.Changed() {
		t.Errorf("again: %v, %v", u.Changes, err)
	}
}

// crashIO fails every write after the first n, as a crash would.
type crashIO struct {
	n, done int
}

var errCrash = errors.New("crash")

func (w *crashIO) step() error {
	if w.done >= w.n {
		return errCrash
	}
	w.done++
	return nil
}
func (w *crashIO) writeConfig(c *bcdconfig.Config, path string) error {
	if err := w.step(); err != nil {
		return err
	}
	return diskIO{}.writeConfig(c, path)
}
func (w *crashIO) writeKey(dir, pin string, pub *ecdsa.PublicKey) error {
	if err := w.step(); err != nil {
		return err
	}
	return diskIO{}.writeKey(dir, pin, pub)
}
func (w *crashIO) removeKey(dir string) error {
	if err := w.step(); err != nil {
		return err
	}
	return diskIO{}.removeKey(dir)
}

// R16.2: a crash between any two writes leaves a config.toml that loads
// and a join-encryption.jwk that matches one of its pins; learning again
// completes the rotation.
func TestLearnStatementsCrashSafe(t *testing.T) {
	for _, tt := range []struct {
		name       string
		statements func(r *rotation) []string
	}{
		{name: "two rotations, old keys retired", statements: func(r *rotation) []string { return r.twoRotations(t) }},
		{name: "one rotation prepared", statements: func(r *rotation) []string {
			return []string{stmt(t, pki.KindJoinEncryption, pki.ActionTrust, r.en[0], r.en[1])}
		}},
	} {
		for n := range 4 {
			r := newRotation(t)
			_, _, err := learnStatements(r.path, tt.statements(r), &crashIO{n: n})
			if err != nil && !errors.Is(err, errCrash) {
				t.Fatalf("%s, crash after %d writes: %v", tt.name, n, err)
			}
			cfg, err := bcdconfig.Load(r.path)
			if err != nil {
				t.Fatalf("%s, crash after %d writes: config: %v", tt.name, n, err)
			}
			if _, _, found, err := bcdconfig.LoadEncryptionKeySet(r.dir, cfg.JoinEncryptionPins()); err != nil || !found {
				t.Errorf("%s, crash after %d writes: jwk found %v, err %v (pins %v)", tt.name, n, found, err, cfg.JoinEncryptionPins())
			}
			if _, _, err := LearnStatements(r.path, tt.statements(r)); err != nil {
				t.Fatal(err)
			}
			cfg, _ = bcdconfig.Load(r.path)
			key, _, _, err := bcdconfig.LoadEncryptionKeySet(r.dir, cfg.JoinEncryptionPins())
			if err != nil || !pki.PinMatches(bcdconfig.Newest(cfg.JoinEncryptionPins()), key) {
				t.Errorf("%s, crash after %d writes, learnt again: the jwk is not the newest key (%v)", tt.name, n, err)
			}
		}
	}
}

// R16.2: the live sets follow what was learned and persist it; without a
// path they change in memory only.
func TestPinsLearn(t *testing.T) {
	r := newRotation(t)
	cfg, err := bcdconfig.Load(r.path)
	if err != nil {
		t.Fatal(err)
	}
	p := NewPins(r.path, cfg, nil)
	st := []string{stmt(t, pki.KindServingCA, pki.ActionTrust, r.ca[0], r.ca[1])}
	u, err := p.Learn("test", st)
	if err != nil || !u.Changed() {
		t.Fatalf("changed %v, err %v", u.Changed(), err)
	}
	want := []string{bcdconfigtest.PinOf(t, r.ca[0]), bcdconfigtest.PinOf(t, r.ca[1])}
	if diff := cmp.Diff(want, p.Set(pki.KindServingCA)); diff != "" {
		t.Errorf("live (-want +got):\n%s", diff)
	}
	saved, _ := bcdconfig.Load(r.path)
	if diff := cmp.Diff(want, saved.ServingCAPins()); diff != "" {
		t.Errorf("saved (-want +got):\n%s", diff)
	}

	mem := NewPins("", cfg, nil)
	if _, err := mem.Learn("test", st); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, mem.Set(pki.KindServingCA)); diff != "" {
		t.Errorf("in memory (-want +got):\n%s", diff)
	}

	// A config.toml that cannot be written: the sets are used anyway.
	gone := NewPins(filepath.Join(t.TempDir(), "missing", "config.toml"), cfg, nil)
	if _, err := gone.Learn("test", st); err == nil {
		t.Error("no error for a config that cannot be read")
	}
	if diff := cmp.Diff(want, gone.Set(pki.KindServingCA)); diff != "" {
		t.Errorf("after a failed save (-want +got):\n%s", diff)
	}
}

// R21.3: after a prepare and a rollback of join-encryption and
// join-signing, the "trust" statements replayed alone (as a network
// attacker answering Keys would, copying them from the well-known
// document) never pin the rolled-back keys again, across a restart; and
// the same rollback shown again rewrites nothing and logs nothing.
func TestPinsOnlyMoveForward(t *testing.T) {
	r := newRotation(t)
	cfg, err := bcdconfig.Load(r.path)
	if err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	p := NewPins(r.path, cfg, log)
	trust := []string{
		stmt(t, pki.KindJoinEncryption, pki.ActionTrust, r.en[0], r.en[1]),
		stmt(t, pki.KindJoinSigning, pki.ActionTrust, r.sg[0], r.sg[1]),
	}
	rollback := append(slices.Clone(trust),
		stmt(t, pki.KindJoinEncryption, pki.ActionRetire, r.en[0], r.en[1]),
		stmt(t, pki.KindJoinSigning, pki.ActionRetire, r.sg[0], r.sg[1]),
	)
	if _, err := p.Learn("prepare", trust); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Learn("rollback", rollback); err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{
		pki.KindJoinEncryption: {bcdconfigtest.PinOf(t, r.en[0])},
		pki.KindJoinSigning:    {bcdconfigtest.PinOf(t, r.sg[0])},
	}
	check := func(what string, p *Pins) {
		t.Helper()
		for kind, w := range want {
			if diff := cmp.Diff(w, p.Set(kind)); diff != "" {
				t.Errorf("%s: %s (-want +got):\n%s", what, kind, diff)
			}
		}
	}
	check("after the rollback", p)

	before, err := os.ReadFile(r.path)
	if err != nil {
		t.Fatal(err)
	}
	info, _ := os.Stat(r.path)
	logs.Reset()
	for _, replay := range [][]string{trust, rollback, {trust[0]}, {trust[1]}} {
		u, err := p.Learn("keys", replay)
		if err != nil || u.Changed() {
			t.Errorf("replay %d statements: changed %v, err %v", len(replay), u.Changed(), err)
		}
	}
	check("after the replays", p)
	after, _ := os.ReadFile(r.path)
	info2, _ := os.Stat(r.path)
	if string(before) != string(after) || !info.ModTime().Equal(info2.ModTime()) {
		t.Error("config.toml was rewritten though nothing changed")
	}
	if logs.Len() != 0 {
		t.Errorf("log lines though nothing changed:\n%s", logs.String())
	}

	// A restarted bcd reads the retirements from config.toml.
	saved, err := bcdconfig.Load(r.path)
	if err != nil {
		t.Fatal(err)
	}
	if len(saved.RetiredPins) != 2 {
		t.Errorf("retired_pins = %v, want the two rolled-back keys", saved.RetiredPins)
	}
	restarted := NewPins(r.path, saved, nil)
	if _, err := restarted.Learn("keys", trust); err != nil {
		t.Fatal(err)
	}
	check("after a restart and a replay", restarted)
	if got := restarted.Preview(pki.KindJoinSigning, trust); !slices.Equal(got, want[pki.KindJoinSigning]) {
		t.Errorf("Preview pins a rolled-back key: %v", got)
	}
}
