// Package rotation rotates the keys of the machine PKI in phases (R16.1) and
// keeps every API replica on the same keys through the database.
//
// Each kind of key (ca.Kinds) has generations in the pki_keys table.
// Generation 1 is the PKI directory's key (its row holds no private key:
// every replica reads it from its own copy of the directory); later
// generations hold their private key encrypted with BETTER_COMPUTE_SECRET.
// A generation is next (prepared: trusted and announced, nothing signed with
// it), current (signs), previous (activated over: still accepted), then
// retired (refused) or discarded (rolled back).
//
// A Ring is one replica's view: it seeds generation 1, builds a ca.Bundle
// from the rows (the current keys, plus everything accepted) and swaps it
// into the startup bundle's ca.Live whenever the rows change, so joins,
// renewals, sessions and the agent listener pick a phase up without a
// restart. Rotate is the one way a phase changes; the CLI runs it against
// the database directly.
//
// SECURITY, what binds what (R16.2): for the kinds a daemon pins
// (serving-ca, join-signing, join-encryption) the next key is announced
// only as a pki.KeyStatement its current key signs, and a key is retired by
// a statement the key replacing it signs. Daemons apply a statement only
// when a key they already pin signed it, so the database, the gateway and
// the network can carry statements but not make one; only the holder of
// BETTER_COMPUTE_SECRET (who can decrypt the current key) can. The node CA
// and the command-signing key reach daemons in answers the join-signing key
// signs. Who may choose to rotate: whoever runs `better-compute pki rotate`
// with the database and the secret, the same person who can already read
// every key.
package rotation

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// States of a key generation.
const (
	StateNext      = "next"
	StateCurrent   = "current"
	StatePrevious  = "previous"
	StateRetired   = "retired"
	StateDiscarded = "discarded"
)

// DefaultPoll is how often a replica looks for a phase another one (or the
// CLI) wrote.
const DefaultPoll = 2 * time.Second

// Config is what a Ring needs.
type Config struct {
	DB *store.DB
	// Base is the PKI directory's bundle, loaded with the secret: the keys
	// of generation 1. It follows the Ring (ca.Bundle.Now).
	Base *ca.Bundle
	// Secret decrypts the keys of later generations.
	Secret []byte
	Log    *slog.Logger
	// Poll: DefaultPoll when zero.
	Poll time.Duration
}

// Ring is one replica's view of the rotating keys.
type Ring struct {
	cfg  Config
	live *ca.Live

	mu      sync.Mutex
	version string
	keys    map[genKey]crypto.Signer
}

type genKey struct {
	kind string
	gen  int64
}

// Open seeds generation 1 of every kind from cfg.Base when no replica did,
// checks the database holds this PKI directory's keys, and loads the
// current bundle into cfg.Base's Live.
func Open(ctx context.Context, cfg Config) (*Ring, error) {
	if cfg.DB == nil || cfg.Base == nil {
		return nil, errors.New("rotation: the store and the bundle are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Poll <= 0 {
		cfg.Poll = DefaultPoll
	}
	r := &Ring{cfg: cfg, keys: map[genKey]crypto.Signer{}, live: ca.NewLive(cfg.Base)}
	if err := seed(ctx, cfg.DB, cfg.Base); err != nil {
		return nil, err
	}
	if _, err := r.Reload(ctx); err != nil {
		return nil, err
	}
	return r, nil
}

// seed writes generation 1 of each kind that has no row, and refuses a
// database whose generation 1 is another PKI directory's.
func seed(ctx context.Context, db *store.DB, base *ca.Bundle) error {
	return db.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.LockPKIKeys(ctx); err != nil {
			return err
		}
		rows, err := tx.ListPKIKeys(ctx)
		if err != nil {
			return err
		}
		for _, kind := range ca.Kinds {
			der, _ := base.KeyOf(kind)
			i := slices.IndexFunc(rows, func(k store.PKIKey) bool { return k.Kind == kind && k.Gen == 1 })
			if i >= 0 {
				if string(rows[i].Cert) != string(der) {
					return errs.New(errs.InvalidConfig, "the PKI directory does not hold the database's first %s key: this database belongs to another machine PKI (pki.dir or the database is not the one this deployment uses)", kind)
				}
				continue
			}
			if _, err := tx.InsertPKIKey(ctx, store.PKIKey{Kind: kind, Gen: 1, State: StateCurrent, Cert: der}); err != nil {
				return err
			}
		}
		return nil
	})
}

// Current returns the bundle of the keys in force now.
func (r *Ring) Current() *ca.Bundle { return r.cfg.Base.Now() }

// Run reloads the keys whenever the database says they changed, until ctx
// ends. A failed look is logged and tried again at the next poll: the
// bundle in force stays.
func (r *Ring) Run(ctx context.Context) {
	t := time.NewTicker(r.cfg.Poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if changed, err := r.Reload(ctx); err != nil {
			if ctx.Err() == nil {
				r.cfg.Log.Warn("machine PKI keys: cannot reload; the keys in force stay", "err", err)
			}
		} else if changed {
			b := r.Current()
			r.cfg.Log.Info("machine PKI keys changed", "statements", len(b.KeyStatements))
		}
	}
}

// Reload reads the rows when their version moved and swaps the bundle in.
// It reports whether it did.
func (r *Ring) Reload(ctx context.Context) (bool, error) {
	var version string
	var rows []store.PKIKey
	err := r.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		if version, err = tx.PKIKeysVersion(ctx); err != nil {
			return err
		}
		r.mu.Lock()
		same := version == r.version
		r.mu.Unlock()
		if same {
			return nil
		}
		rows, err = tx.ListPKIKeys(ctx)
		return err
	})
	if err != nil || rows == nil {
		return false, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	b, err := build(r.cfg.Base, rows, func(k store.PKIKey) (crypto.Signer, error) { return r.keyLocked(k) })
	if err != nil {
		return false, err
	}
	r.live.Set(b)
	r.version = version
	return true, nil
}

// keyLocked returns the private key of row k, decrypting it once.
func (r *Ring) keyLocked(k store.PKIKey) (crypto.Signer, error) {
	id := genKey{k.Kind, k.Gen}
	if s, ok := r.keys[id]; ok {
		return s, nil
	}
	s, err := decryptKey(r.cfg.Base, r.cfg.Secret, k)
	if err != nil {
		return nil, err
	}
	r.keys[id] = s
	return s, nil
}

// decryptKey returns the private key of row k: the PKI directory's for
// generation 1, else key_pem (or key_pem_next, while the secret rotates)
// decrypted with secret, checked against the row's public key.
func decryptKey(base *ca.Bundle, secret []byte, k store.PKIKey) (crypto.Signer, error) {
	if k.KeyPEM == "" {
		// Only generation 1 lives in the PKI directory, and only as the
		// directory's own certificate: a row cannot borrow its key.
		der, key := base.KeyOf(k.Kind)
		if k.Gen != 1 || string(der) != string(k.Cert) {
			return nil, fmt.Errorf("%s generation %d: no key, and not the PKI directory's", k.Kind, k.Gen)
		}
		return key, nil
	}
	key, err := ca.DecryptKey([]byte(k.KeyPEM), secret)
	if err != nil && k.KeyPEMNext != "" {
		key, err = ca.DecryptKey([]byte(k.KeyPEMNext), secret)
	}
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "cannot decrypt %s generation %d with BETTER_COMPUTE_SECRET: %s", k.Kind, k.Gen, errs.MessageOf(err))
	}
	pub, _, err := ca.PublicKeyOfDER(k.Kind, k.Cert)
	if err != nil {
		return nil, err
	}
	if !pub.Equal(key.Public()) {
		return nil, fmt.Errorf("%s generation %d: the key does not match its certificate", k.Kind, k.Gen)
	}
	return key, nil
}

// build makes the bundle of rows: for each kind the current generation
// signs, and the current, next and previous are accepted (current first).
func build(base *ca.Bundle, rows []store.PKIKey, keyOf func(store.PKIKey) (crypto.Signer, error)) (*ca.Bundle, error) {
	b := *base
	b.NodeCAs, b.ServingCAs, b.CommandCerts, b.OpenKeys, b.KeyStatements, b.RetiredNodeCAs = nil, nil, nil, nil, nil, nil
	for _, kind := range ca.Kinds {
		live := liveRows(rows, kind)
		if len(live) == 0 || live[0].State != StateCurrent {
			return nil, fmt.Errorf("machine PKI keys: no current %s key in the database", kind)
		}
		for i, k := range live {
			if err := place(&b, k, i == 0, keyOf); err != nil {
				return nil, err
			}
		}
	}
	for _, k := range rows {
		if k.Kind == ca.KindNodeCA && k.State == StateRetired {
			if _, cert, err := ca.PublicKeyOfDER(k.Kind, k.Cert); err == nil && cert != nil {
				b.RetiredNodeCAs = append(b.RetiredNodeCAs, cert)
			}
		}
		if ca.Pinned(k.Kind) {
			for _, st := range []string{k.Statement, k.RetireStatement} {
				if st != "" {
					b.KeyStatements = append(b.KeyStatements, st)
				}
			}
		}
	}
	return &b, nil
}

// liveRows returns kind's current, next and previous rows, current first.
func liveRows(rows []store.PKIKey, kind string) []store.PKIKey {
	var out []store.PKIKey
	for _, state := range []string{StateCurrent, StateNext, StatePrevious} {
		for _, k := range rows {
			if k.Kind == kind && k.State == state {
				out = append(out, k)
			}
		}
	}
	return out
}

// place puts row k into b: as the signing key when current, and into the
// kind's accepted list.
func place(b *ca.Bundle, k store.PKIKey, current bool, keyOf func(store.PKIKey) (crypto.Signer, error)) error {
	_, cert, err := ca.PublicKeyOfDER(k.Kind, k.Cert)
	if err != nil {
		return err
	}
	// Only the current key signs; the join-encryption key opens seals in
	// every accepted generation, so those are decrypted too.
	var key crypto.Signer
	if current || k.Kind == ca.KindJoinEncryption {
		if key, err = keyOf(k); err != nil {
			return err
		}
	}
	switch k.Kind {
	case ca.KindNodeCA:
		if current {
			b.NodeCA, b.NodeCAKey = cert, key
		}
		b.NodeCAs = append(b.NodeCAs, cert)
	case ca.KindServingCA:
		if current {
			b.ServingCA, b.ServingCAKey = cert, key
		}
		b.ServingCAs = append(b.ServingCAs, cert)
	case ca.KindCommandSigning:
		if current {
			b.CommandSigningCert, b.CommandSigningKey = cert, key
		}
		b.CommandCerts = append(b.CommandCerts, cert)
	case ca.KindJoinSigning:
		if current {
			b.JoinSigningCert, b.JoinSigningKey = cert, key
		}
	case ca.KindJoinEncryption:
		ek, ok := key.(*ecdsa.PrivateKey)
		if !ok {
			return fmt.Errorf("join-encryption generation %d: not an ECDSA key", k.Gen)
		}
		if current {
			b.JoinEncryptionKey = ek
		}
		b.OpenKeys = append(b.OpenKeys, ek)
	}
	return nil
}
