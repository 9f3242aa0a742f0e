package rotation

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// KindSecret is BETTER_COMPUTE_SECRET's row in pki_keys: its generations
// record fingerprints only (a hash, never the secret).
const KindSecret = "secret"

// SecretFingerprint names a secret without revealing it.
func SecretFingerprint(secret []byte) string {
	sum := sha256.Sum256(append([]byte("better-compute secret fingerprint v1\x00"), secret...))
	return "sha256/" + base64.StdEncoding.EncodeToString(sum[:])
}

// SecretOp is one phase of the secret's rotation.
type SecretOp struct {
	Phase string
	// Secret is the secret in force; Next the new one (prepare only).
	Secret, Next []byte
	// PKIDir is the PKI directory whose key files are re-encrypted too.
	PKIDir string
	Actor  string
	Now    time.Time
}

// RotateSecret runs one phase of BETTER_COMPUTE_SECRET's rotation:
//
//   - prepare: every key is encrypted under the next secret too (rows'
//     key_pem_next, the PKI directory's <file>.next);
//   - activate: the next secret's copies become the primary ones, the old
//     kept beside them, so replicas on either secret open every key;
//     restart each replica with the new secret now;
//   - retire: the old secret's copies are deleted;
//   - rollback: undoes activate, or drops what prepare made.
//
// No key changes, so daemons see nothing. While it runs no key may rotate
// (Rotate refuses), so every key is always under both secrets.
func RotateSecret(ctx context.Context, db *store.DB, base *ca.Bundle, op SecretOp) (Result, error) {
	if err := seed(ctx, db, base); err != nil {
		return Result{}, err
	}
	first := store.PKIKey{Kind: KindSecret, Gen: 1, State: StateCurrent, Cert: []byte(SecretFingerprint(op.Secret))}
	res, err := phaseTx(ctx, db, Op{Kind: KindSecret, Phase: op.Phase, Actor: op.Actor}, func(rows []store.PKIKey) (changes, error) {
		var c changes
		secrets := kindRows(rows, KindSecret)
		if len(secrets) == 0 {
			// The secret in force becomes generation 1.
			secrets, c.inserted = []store.PKIKey{first}, []store.PKIKey{first}
		}
		t := secretTransition{op: op, base: base, secrets: secrets, keys: keyRows(rows)}
		updated, inserted, r, err := t.apply()
		if err != nil {
			return changes{}, err
		}
		c.inserted = append(c.inserted, inserted...)
		c.updated, c.result = updated, r
		return c, nil
	})
	if err != nil {
		return Result{}, err
	}
	// The directory follows the committed phase: Load opens either copy,
	// so a crash between the two leaves every key readable.
	switch {
	case op.Phase == PhaseActivate:
		err = ca.SwapDirKeys(op.PKIDir, true)
	case op.Phase == PhaseRetire:
		err = ca.DropDirKeys(op.PKIDir, ca.SuffixPrev)
	case op.Phase == PhaseRollback && res.Current == res.Gen:
		err = ca.DropDirKeys(op.PKIDir, ca.SuffixNext)
	case op.Phase == PhaseRollback:
		err = ca.SwapDirKeys(op.PKIDir, false)
	}
	if err != nil {
		return res, errs.Wrap(err, errs.Internal, "the database is at the secret's %s phase, but the PKI directory %s could not follow: %v; run the same phase again", op.Phase, op.PKIDir, err)
	}
	return res, nil
}

// keyRows returns the rows of keys (not the secret's), each of them once.
func keyRows(rows []store.PKIKey) []store.PKIKey {
	var out []store.PKIKey
	for _, k := range rows {
		if k.Kind != KindSecret {
			out = append(out, k)
		}
	}
	return out
}

type secretTransition struct {
	op      SecretOp
	base    *ca.Bundle
	secrets []store.PKIKey
	keys    []store.PKIKey
}

func (t secretTransition) find(state string) (store.PKIKey, bool) {
	for _, k := range t.secrets {
		if k.State == state {
			return k, true
		}
	}
	return store.PKIKey{}, false
}

func (t secretTransition) apply() (updated, inserted []store.PKIKey, res Result, err error) {
	cur, _ := t.find(StateCurrent)
	next, hasNext := t.find(StateNext)
	prev, hasPrev := t.find(StatePrevious)
	res = Result{Kind: KindSecret, Phase: t.op.Phase}
	switch t.op.Phase {
	case PhasePrepare:
		if hasNext || hasPrev {
			return nil, nil, res, errs.New(errs.InvalidState, "the secret is rotating already: activate, retire or roll back that rotation first")
		}
		if err := ca.CheckSecret(t.op.Next); err != nil {
			return nil, nil, res, err
		}
		if string(t.op.Next) == string(t.op.Secret) {
			return nil, nil, res, errs.Invalid("next secret", "the new secret is the one in force")
		}
		for _, k := range t.keys {
			if k.KeyPEM == "" {
				continue // in the PKI directory, re-encrypted below
			}
			key, err := decryptKey(t.base, t.op.Secret, k)
			if err != nil {
				return nil, nil, res, err
			}
			data, err := ca.EncryptKey(key, t.op.Next)
			if err != nil {
				return nil, nil, res, err
			}
			k.KeyPEMNext = string(data)
			updated = append(updated, k)
		}
		if err := ca.RekeyDir(t.op.PKIDir, t.op.Secret, t.op.Next); err != nil {
			return nil, nil, res, err
		}
		n := store.PKIKey{Kind: KindSecret, Gen: maxGen(t.secrets) + 1, State: StateNext, Cert: []byte(SecretFingerprint(t.op.Next))}
		res.Gen, res.Current, res.Fingerprint = n.Gen, cur.Gen, string(n.Cert)
		return updated, []store.PKIKey{n}, res, nil
	case PhaseActivate:
		if !hasNext {
			return nil, nil, res, errs.New(errs.InvalidState, "no new secret is prepared: run --phase prepare first")
		}
		cur.State, next.State = StatePrevious, StateCurrent
		res.Gen, res.Current, res.Fingerprint = next.Gen, next.Gen, string(next.Cert)
		return append(t.swapped(), cur, next), nil, res, nil
	case PhaseRetire:
		if !hasPrev {
			return nil, nil, res, errs.New(errs.InvalidState, "no previous secret to retire")
		}
		prev.State = StateRetired
		res.Gen, res.Current, res.Fingerprint = prev.Gen, cur.Gen, string(prev.Cert)
		return append(t.dropped(), prev), nil, res, nil
	default:
		if hasPrev {
			cur.State, prev.State = StateNext, StateCurrent
			res.Gen, res.Current, res.Fingerprint = cur.Gen, prev.Gen, string(cur.Cert)
			return append(t.swapped(), cur, prev), nil, res, nil
		}
		if hasNext {
			next.State = StateDiscarded
			res.Gen, res.Current, res.Fingerprint = cur.Gen, cur.Gen, string(next.Cert)
			return append(t.dropped(), next), nil, res, nil
		}
		return nil, nil, res, errs.New(errs.InvalidState, "nothing to roll back: the secret is not rotating")
	}
}

// swapped exchanges every key row's two ciphertexts.
func (t secretTransition) swapped() []store.PKIKey {
	var out []store.PKIKey
	for _, k := range t.keys {
		if k.KeyPEMNext != "" {
			k.KeyPEM, k.KeyPEMNext = k.KeyPEMNext, k.KeyPEM
			out = append(out, k)
		}
	}
	return out
}

// dropped clears every key row's second ciphertext.
func (t secretTransition) dropped() []store.PKIKey {
	var out []store.PKIKey
	for _, k := range t.keys {
		if k.KeyPEMNext != "" {
			k.KeyPEMNext = ""
			out = append(out, k)
		}
	}
	return out
}

func maxGen(rows []store.PKIKey) int64 {
	var g int64
	for _, k := range rows {
		g = max(g, k.Gen)
	}
	return g
}

// secretRotating reports whether the secret is between prepare and retire.
func secretRotating(rows []store.PKIKey) bool {
	for _, k := range kindRows(rows, KindSecret) {
		if k.State == StateNext || k.State == StatePrevious {
			return true
		}
	}
	return false
}
