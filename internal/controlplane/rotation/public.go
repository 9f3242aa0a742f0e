package rotation

import (
	"context"
	"crypto/ecdsa"
	"crypto/x509"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Public is what a daemon is installed with, read from the database
// without the secret: the pins of the keys in force and the join-encryption
// key to seal to.
type Public struct {
	// Pins are the current keys' pins.
	Pins pki.Pins
	// Sets are the pins in force of each pinned kind (current, and next or
	// previous while it rotates), oldest first.
	Sets map[string][]string
	// EncryptionKey is the current join-encryption key.
	EncryptionKey *ecdsa.PublicKey
	// ServingCAs are the serving CAs in force, oldest first: what a
	// gateway's api_ca_file holds while the serving CA rotates.
	ServingCAs []*x509.Certificate
}

// ErrNoKeys: no server recorded its PKI directory's keys yet.
var ErrNoKeys = errs.New(errs.NotFound, "no keys in the database yet: start the server once (it records the PKI directory's keys)")

// PublicKeys reads Public from the database.
func PublicKeys(ctx context.Context, db *store.DB) (Public, error) {
	var rows []store.PKIKey
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListPKIKeys(ctx)
		return err
	}); err != nil {
		return Public{}, err
	}
	p := Public{Sets: map[string][]string{}}
	current := map[string]string{}
	for _, k := range rows {
		if !ca.Pinned(k.Kind) || (k.State != StateCurrent && k.State != StateNext && k.State != StatePrevious) {
			continue
		}
		pub, cert, err := ca.PublicKeyOfDER(k.Kind, k.Cert)
		if err != nil {
			return Public{}, err
		}
		if k.Kind == ca.KindServingCA {
			p.ServingCAs = append(p.ServingCAs, cert)
		}
		pin, err := pki.Pin(pub)
		if err != nil {
			return Public{}, err
		}
		p.Sets[k.Kind] = append(p.Sets[k.Kind], pin)
		if k.State == StateCurrent {
			current[k.Kind] = pin
			if k.Kind == ca.KindJoinEncryption {
				p.EncryptionKey = pub
			}
		}
	}
	p.Pins = pki.Pins{ServingCA: current[ca.KindServingCA], JoinSigning: current[ca.KindJoinSigning], JoinEncryption: current[ca.KindJoinEncryption]}
	if p.Pins.ServingCA == "" || p.Pins.JoinSigning == "" || p.EncryptionKey == nil {
		return Public{}, ErrNoKeys
	}
	return p, nil
}
