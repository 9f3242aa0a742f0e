package rotation

import (
	"context"
	"crypto"
	"crypto/x509"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Phases of a rotation.
const (
	PhasePrepare  = "prepare"
	PhaseActivate = "activate"
	PhaseRetire   = "retire"
	PhaseRollback = "rollback"
)

// Phases lists them in order.
var Phases = []string{PhasePrepare, PhaseActivate, PhaseRetire, PhaseRollback}

// Op is one phase of one key's rotation.
type Op struct {
	Kind  string
	Phase string
	// Actor names who asked, for the audit row ("cli:<user>").
	Actor string
	Now   time.Time
	// Force retires though nodes are behind (R21.2): they will need a
	// person (a new join) unless another path brings them back.
	Force bool
}

// Result says what a phase did.
type Result struct {
	Kind  string `json:"key"`
	Phase string `json:"phase"`
	// Gen is the generation the phase was about: the one prepared,
	// activated, retired or discarded.
	Gen int64 `json:"generation"`
	// Current is the generation that signs after the phase.
	Current int64 `json:"current"`
	// Fingerprint is the pin of Gen's public key.
	Fingerprint string `json:"fingerprint"`
}

// Rotate runs one phase of op.Kind's rotation in one transaction, with its
// event and audit row, and returns what it did. Replicas pick it up at
// their next poll (DefaultPoll). base and secret are the PKI directory's
// bundle and BETTER_COMPUTE_SECRET: the current key signs the statement
// that announces or retires another.
//
// Errors: errs.InvalidArgument for an unknown key or phase,
// errs.InvalidState for a phase out of order (activate with nothing
// prepared, prepare while an older key is still accepted, ...).
func Rotate(ctx context.Context, db *store.DB, base *ca.Bundle, secret []byte, op Op) (Result, error) {
	if err := ca.ValidKind(op.Kind); err != nil {
		return Result{}, err
	}
	if !slices.Contains(Phases, op.Phase) {
		return Result{}, errs.Invalid("phase", "%q is not a phase (prepare, activate, retire or rollback)", op.Phase)
	}
	if err := seed(ctx, db, base); err != nil {
		return Result{}, err
	}
	if op.Phase == PhaseRetire && !op.Force {
		if err := refuseBehind(ctx, db, op); err != nil {
			return Result{}, err
		}
	}
	return phaseTx(ctx, db, op, func(rows []store.PKIKey) (changes, error) {
		if secretRotating(rows) {
			return changes{}, errs.New(errs.InvalidState, "BETTER_COMPUTE_SECRET is rotating: retire or roll back that rotation before rotating a key (every key must stay readable under both secrets)")
		}
		return transition{base: base, secret: secret, op: op, rows: kindRows(rows, op.Kind)}.apply()
	})
}

// refuseBehind refuses to retire op.Kind's older generation while nodes
// have not caught up with the one in force (R21.2): a daemon that does not
// hold the new pin must then follow the chain of statements, and a node on
// a certificate the old node CA issued loses its session until it renews.
// It names how many and which.
func refuseBehind(ctx context.Context, db *store.DB, op Op) error {
	st, err := Status(ctx, db, op.Now)
	if err != nil {
		return err
	}
	for _, ks := range st {
		if ks.Kind != op.Kind || ks.Behind == 0 {
			continue
		}
		more := ""
		if ks.Behind > len(ks.BehindNodes) {
			more = fmt.Sprintf(" and %d more", ks.Behind-len(ks.BehindNodes))
		}
		return errs.New(errs.InvalidState,
			"%d of %d nodes are behind the %s rotation (%s%s): they catch up at their next renewal or session; watch pki status, or pass --force to retire now",
			ks.Behind, ks.Nodes, op.Kind, strings.Join(ks.BehindNodes, ", "), more)
	}
	return nil
}

// phaseTx runs one phase in one transaction: under the rotation lock it
// reads every row, lets apply compute the change, writes it, and records
// the phase's event and audit row.
func phaseTx(ctx context.Context, db *store.DB, op Op, apply func(rows []store.PKIKey) (changes, error)) (Result, error) {
	var res Result
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.LockPKIKeys(ctx); err != nil {
			return err
		}
		rows, err := tx.ListPKIKeys(ctx)
		if err != nil {
			return err
		}
		changed, err := apply(rows)
		if err != nil {
			return err
		}
		for _, k := range changed.inserted {
			if _, err := tx.InsertPKIKey(ctx, k); err != nil {
				return err
			}
		}
		for _, k := range changed.updated {
			if err := tx.UpdatePKIKey(ctx, k); err != nil {
				return err
			}
		}
		res = changed.result
		return record(ctx, tx, op, res)
	})
	return res, err
}

// record writes the phase's event and audit row in the root tenant.
func record(ctx context.Context, tx *store.Tx, op Op, res Result) error {
	root, err := tx.RootTenantID(ctx)
	if err != nil || root == "" {
		return err
	}
	past := map[string]string{PhasePrepare: "prepared", PhaseActivate: "activated", PhaseRetire: "retired", PhaseRollback: "rolled-back"}[op.Phase]
	data := map[string]any{"key": res.Kind, "generation": res.Gen, "current": res.Current, "fingerprint": res.Fingerprint}
	if err := events.Publish(ctx, tx, nil, events.Event{TenantID: root, Type: "pki.key." + past, Subject: res.Kind, Data: data}); err != nil {
		return err
	}
	actor := op.Actor
	if actor == "" {
		actor = "system"
	}
	return events.Audit(ctx, tx, events.Entry{TenantID: root, Actor: actor, Action: "pki.key." + past, Resource: authz.TenantResource(root), Data: data})
}

func kindRows(rows []store.PKIKey, kind string) []store.PKIKey {
	var out []store.PKIKey
	for _, k := range rows {
		if k.Kind == kind {
			out = append(out, k)
		}
	}
	return out
}

// transition computes one phase over one kind's rows.
type transition struct {
	base   *ca.Bundle
	secret []byte
	op     Op
	rows   []store.PKIKey
}

type changes struct {
	inserted, updated []store.PKIKey
	result            Result
}

func (t transition) find(state string) (store.PKIKey, bool) {
	for _, k := range t.rows {
		if k.State == state {
			return k, true
		}
	}
	return store.PKIKey{}, false
}

func (t transition) apply() (changes, error) {
	cur, ok := t.find(StateCurrent)
	if !ok {
		return changes{}, fmt.Errorf("no current %s key in the database", t.op.Kind)
	}
	next, hasNext := t.find(StateNext)
	prev, hasPrev := t.find(StatePrevious)
	switch t.op.Phase {
	case PhasePrepare:
		if hasNext {
			return changes{}, errs.New(errs.InvalidState, "%s generation %d is prepared already: activate it, or roll it back", t.op.Kind, next.Gen)
		}
		if hasPrev {
			return changes{}, errs.New(errs.InvalidState, "%s generation %d is still accepted: retire it first (pki rotate %s --phase retire)", t.op.Kind, prev.Gen, t.op.Kind)
		}
		return t.prepare(cur)
	case PhaseActivate:
		if !hasNext {
			return changes{}, errs.New(errs.InvalidState, "no %s key is prepared: run --phase prepare first", t.op.Kind)
		}
		cur.State, next.State = StatePrevious, StateCurrent
		return t.done(next, next.Gen, cur, next)
	case PhaseRetire:
		if !hasPrev {
			return changes{}, errs.New(errs.InvalidState, "no previous %s key to retire", t.op.Kind)
		}
		prev.State = StateRetired
		if err := t.statement(&prev, cur, pki.ActionRetire); err != nil {
			return changes{}, err
		}
		return t.done(prev, cur.Gen, prev)
	default: // rollback
		if hasPrev {
			// From activate: the previous key signs again, the new one
			// is dropped and its retirement announced.
			cur.State, prev.State = StateDiscarded, StateCurrent
			if err := t.statement(&cur, prev, pki.ActionRetire); err != nil {
				return changes{}, err
			}
			return t.done(cur, prev.Gen, cur, prev)
		}
		if hasNext {
			next.State = StateDiscarded
			if err := t.statement(&next, cur, pki.ActionRetire); err != nil {
				return changes{}, err
			}
			return t.done(next, cur.Gen, next)
		}
		return changes{}, errs.New(errs.InvalidState, "nothing to roll back: no %s key is prepared or activated over another", t.op.Kind)
	}
}

// prepare makes the next generation, encrypted with the secret, announced
// by the current key when daemons pin the kind.
func (t transition) prepare(cur store.PKIKey) (changes, error) {
	gen := int64(1)
	for _, k := range t.rows {
		gen = max(gen, k.Gen+1)
	}
	der, key, err := ca.NewKeyOf(t.op.Kind, t.base.TrustDomain, gen, t.op.Now)
	if err != nil {
		return changes{}, err
	}
	pemKey, err := ca.EncryptKey(key, t.secret)
	if err != nil {
		return changes{}, err
	}
	next := store.PKIKey{Kind: t.op.Kind, Gen: gen, State: StateNext, Cert: der, KeyPEM: string(pemKey)}
	if err := t.statement(&next, cur, pki.ActionTrust); err != nil {
		return changes{}, err
	}
	c, err := t.done(next, cur.Gen)
	c.inserted = []store.PKIKey{next}
	return c, err
}

// statement signs, with signer's key, what signer says of subject (a
// pinned kind only): trust goes in subject.Statement, retire in
// subject.RetireStatement.
func (t transition) statement(subject *store.PKIKey, signer store.PKIKey, action string) error {
	if !ca.Pinned(t.op.Kind) {
		return nil
	}
	key, err := decryptKey(t.base, t.secret, signer)
	if err != nil {
		return err
	}
	st := pki.KeyStatement{Kind: t.op.Kind, Action: action, Signer: spkiOf(key), Subject: spkiOfDER(t.op.Kind, subject.Cert), IssuedAt: t.op.Now.UTC().Truncate(time.Second)}
	enc, err := pki.SignKeyStatement(key, st)
	if err != nil {
		return err
	}
	if action == pki.ActionTrust {
		subject.Statement = enc
	} else {
		subject.RetireStatement = enc
	}
	return nil
}

func (t transition) done(about store.PKIKey, current int64, updated ...store.PKIKey) (changes, error) {
	pub, _, err := ca.PublicKeyOfDER(about.Kind, about.Cert)
	if err != nil {
		return changes{}, err
	}
	pin, err := pki.Pin(pub)
	if err != nil {
		return changes{}, err
	}
	return changes{updated: updated, result: Result{Kind: about.Kind, Phase: t.op.Phase, Gen: about.Gen, Current: current, Fingerprint: pin}}, nil
}

func spkiOf(key crypto.Signer) []byte {
	der, _ := x509.MarshalPKIXPublicKey(key.Public())
	return der
}

func spkiOfDER(kind string, der []byte) []byte {
	pub, _, err := ca.PublicKeyOfDER(kind, der)
	if err != nil {
		return nil
	}
	out, _ := x509.MarshalPKIXPublicKey(pub)
	return out
}
