// Package config is bcd's side of its configuration at run time: the pin
// sets it holds live (Pins), shared by the join, the renewer and the
// session, and the rotation statements it learns into config.toml and
// join-encryption.jwk (LearnStatements), crash-safely. The files' format
// (keys, defaults, validation, reading and writing) is shared/bcdconfig's,
// which the install script and `better-compute dev` write too.
//
// SECURITY: the three pin sets are the daemon's only trust anchors. A set
// gains a key only through a statement signed by a key it already holds
// (R16.2), and a key seen retired is never pinned again (R21.3).
package config

import (
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// LearnStatements applies the rotation statements (R16.2) to the
// config.toml at path and, when a pin set changed, writes it back
// atomically, with join-encryption.jwk beside it following the newest
// encryption key. It returns the file's configuration as it now is (no
// defaults applied) and what changed; nothing is written when nothing
// changed.
//
// The file is re-read, not taken from the caller's memory, so a --data-dir
// override or applied defaults never leak into it.
//
// Crash safety: at every step the encryption key on disk hashes to a pin of
// the config.toml on disk (the loader accepts any pin of the set), so a
// crash between two writes leaves a working bcd:
//  1. config.toml gets the new sets, keeping the pin of the key the jwk
//     holds now if the statements retired it;
//  2. join-encryption.jwk gets the newest encryption key (when bcd learned
//     its key; when a rollback leaves a newest key bcd does not hold, the
//     file goes first, and a join fetches the key from the well-known
//     document, checked against the set);
//  3. config.toml gets the final sets, when step 1 kept a retired pin.
//
// A crash after step 1 leaves a retired encryption pin in the set until the
// next answer's statements retire it again, and a jwk behind the newest pin
// is caught up by the next statements that carry the newest key (the only
// write when no set changed).
func LearnStatements(path string, statements []string) (*bcdconfig.Config, bcdconfig.PinUpdate, error) {
	return learnStatements(path, statements, diskIO{})
}

// learnIO is the writes LearnStatements makes, in order; tests stop it
// between two of them, as a crash would.
type learnIO interface {
	writeConfig(c *bcdconfig.Config, path string) error
	writeKey(dir, pin string, pub *ecdsa.PublicKey) error
	removeKey(dir string) error
}

type diskIO struct{}

func (diskIO) writeConfig(c *bcdconfig.Config, path string) error { return c.Write(path) }
func (diskIO) writeKey(dir, pin string, pub *ecdsa.PublicKey) error {
	return bcdconfig.WriteEncryptionKey(dir, pin, pub)
}
func (diskIO) removeKey(dir string) error {
	if err := os.Remove(filepath.Join(dir, bcdconfig.EncryptionKeyFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the stale %s: %w", bcdconfig.EncryptionKeyFile, err)
	}
	return nil
}

func learnStatements(path string, statements []string, w learnIO) (*bcdconfig.Config, bcdconfig.PinUpdate, error) {
	c, err := bcdconfig.LoadRaw(path)
	if err != nil {
		return nil, bcdconfig.PinUpdate{}, err
	}
	dir := filepath.Dir(path)
	before := c.JoinEncryptionPins()
	u := c.ApplyStatements(statements)
	if !u.Changed() {
		return c, u, catchUpKey(dir, before, statements, w)
	}
	encChange, encChanged := u.Kind(pki.KindJoinEncryption)
	if !encChanged || !encChange.Changed() {
		return c, u, w.writeConfig(c, path)
	}
	after := c.JoinEncryptionPins()
	newest := bcdconfig.Newest(after)
	_, onDisk, found, err := bcdconfig.LoadEncryptionKeySet(dir, before)
	if err != nil {
		// A broken jwk is the operator's to fix (LoadEncryptionKey says
		// how); the pins are still worth keeping.
		onDisk, found = "", false
	}
	newKey := encChange.Keys[newest]
	if newKey == nil {
		newKey = keyOf(newest, statements)
	}
	switch {
	case found && onDisk == newest:
		return c, u, w.writeConfig(c, path)
	case newKey == nil:
		// A rollback to a key bcd does not hold: the stale file goes
		// first, so no state names a key the set no longer has.
		if found && !slices.Contains(after, onDisk) {
			if err := w.removeKey(dir); err != nil {
				return c, u, err
			}
		}
		return c, u, w.writeConfig(c, path)
	}
	step := *c
	kept := found && !slices.Contains(after, onDisk)
	if kept {
		step.SetPinSet(pki.KindJoinEncryption, append([]string{onDisk}, after...))
	}
	if err := w.writeConfig(&step, path); err != nil {
		return c, u, err
	}
	if err := w.writeKey(dir, newest, newKey); err != nil {
		return c, u, err
	}
	if !kept {
		return c, u, nil
	}
	return c, u, w.writeConfig(c, path)
}

// catchUpKey writes the newest encryption key of pins to the jwk when the
// jwk holds an older pinned one and the statements carry the newest (a
// crash left it behind): the sets did not change, so config.toml is not
// written.
func catchUpKey(dir string, pins, statements []string, w learnIO) error {
	newest := bcdconfig.Newest(pins)
	_, onDisk, found, err := bcdconfig.LoadEncryptionKeySet(dir, pins)
	if err != nil || !found || onDisk == newest {
		return nil
	}
	if k := keyOf(newest, statements); k != nil {
		return w.writeKey(dir, newest, k)
	}
	return nil
}

// keyOf returns the join-encryption key that hashes to pin from the
// statements' signers and subjects, nil when none does. The pin is already
// in the set, so who signed the statement does not matter: the key is the
// pinned one because it hashes to the pin (after a crash, the statements
// that added it may have been applied by the earlier, interrupted run).
func keyOf(pin string, statements []string) *ecdsa.PublicKey {
	for i, enc := range statements {
		if i >= pki.MaxKeyStatements {
			break
		}
		st, err := pki.ParseKeyStatement(enc)
		if err != nil || st.Kind != pki.KindJoinEncryption {
			continue
		}
		for _, der := range [][]byte{st.Subject, st.Signer} {
			if pki.PinSPKI(der) == pin {
				if k, err := pki.ParseP256SPKI(der); err == nil {
					return k
				}
			}
		}
	}
	return nil
}

// Pins is bcd's live trust anchors: the pin sets of config.toml, shared by
// the join, the renewer and the session, so a key one of them learns is
// used by the others at their next dial. Build it with NewPins.
type Pins struct {
	mu   sync.Mutex
	path string
	sets map[string][]string
	// retired is RetiredPins: keys never pinned again (R21.3).
	retired []string
	log     *slog.Logger
}

// NewPins returns the live pin sets of c, persisted to the config.toml at
// path ("" keeps what is learned in memory only). log receives a line per
// change; nil discards.
func NewPins(path string, c *bcdconfig.Config, log *slog.Logger) *Pins {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Pins{path: path, sets: map[string][]string{}, retired: slices.Clone(c.RetiredPins), log: log}
	for _, k := range bcdconfig.PinKinds() {
		p.sets[k] = c.PinSet(k)
	}
	return p
}

// Preview returns kind's pin set as it would be after statements, without
// learning them: a verifier asks it whether an answer's signing key is
// vouched for by a chain from a pinned key (R21.1) before it checks the
// answer, and learns the statements only from the answer it accepted.
func (p *Pins) Preview(kind string, statements []string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	next, _ := pki.ApplyStatements(kind, p.sets[kind], p.retired, statements)
	return next
}

// Retired returns the keys known retired (a copy).
func (p *Pins) Retired() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.retired)
}

// Set returns kind's pin set now, oldest first (a copy).
func (p *Pins) Set(kind string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sets[kind])
}

// Learn applies statements (from source, for the log: "join answer",
// "renewal answer", "welcome", "well-known", "keys") to the pin sets and
// persists them (LearnStatements). Only statements signed by a pinned key
// count; when nothing changed nothing is written. On a write error the
// sets learned are still used in memory, and the error is returned.
func (p *Pins) Learn(source string, statements []string) (bcdconfig.PinUpdate, error) {
	if len(statements) == 0 {
		return bcdconfig.PinUpdate{}, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	mem := &bcdconfig.Config{RetiredPins: slices.Clone(p.retired)}
	for _, k := range bcdconfig.PinKinds() {
		mem.SetPinSet(k, p.sets[k])
	}
	// Most answers repeat what bcd knows: then config.toml is not even
	// read (only a jwk a crash left behind is caught up, silently).
	if probe := *mem; !probe.ApplyStatements(statements).Changed() {
		if p.path != "" {
			_ = catchUpKey(filepath.Dir(p.path), p.sets[pki.KindJoinEncryption], statements, diskIO{})
		}
		return bcdconfig.PinUpdate{}, nil
	}
	var u bcdconfig.PinUpdate
	var err error
	if p.path != "" {
		var file *bcdconfig.Config
		file, u, err = LearnStatements(p.path, statements)
		if err == nil {
			mem = file
		}
	}
	if p.path == "" || err != nil {
		u = mem.ApplyStatements(statements)
	}
	for _, k := range bcdconfig.PinKinds() {
		p.sets[k] = mem.PinSet(k)
	}
	p.retired = mem.RetiredPins
	for _, c := range u.Changes {
		if !c.Changed() {
			p.log.Debug("keys seen retired", telemetry.LogSource, source, telemetry.LogKind, c.Kind, telemetry.LogRetired, c.Dropped)
			continue
		}
		p.log.Info("learned rotated keys", telemetry.LogSource, source, telemetry.LogKind, c.Kind, telemetry.LogAdded, c.Added, telemetry.LogRetired, c.Retired, telemetry.LogPins, p.sets[c.Kind])
	}
	if err != nil {
		p.log.Error("cannot save the learned pins; using them until bcd restarts", telemetry.LogSource, source, telemetry.LogConfigFile, p.path, telemetry.LogErr, err)
		return u, err
	}
	return u, nil
}

// Held is every pin of every kind, in PinKinds order, oldest first within
// a kind, at most pki.MaxAckedPins (the newest kept): what the daemon
// tells the control plane it holds, signed, in a session's Hello and in a
// renewal (R21.2).
func (p *Pins) Held() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, k := range bcdconfig.PinKinds() {
		out = append(out, p.sets[k]...)
	}
	if len(out) > pki.MaxAckedPins {
		out = out[len(out)-pki.MaxAckedPins:]
	}
	return out
}
