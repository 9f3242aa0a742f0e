package rotation

import (
	"bytes"
	"context"
	"crypto/x509"
	"slices"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Generation is one key generation as status shows it.
type Generation struct {
	Gen         int64     `json:"generation"`
	State       string    `json:"state"`
	Fingerprint string    `json:"fingerprint"`
	CreatedAt   time.Time `json:"createdAt"`
	ChangedAt   time.Time `json:"changedAt"`
	// NotAfter is the certificate's expiry (zero for join-encryption).
	NotAfter time.Time `json:"notAfter,omitzero"`
}

// KeyStatus is one kind of key.
type KeyStatus struct {
	Kind        string       `json:"key"`
	Generations []Generation `json:"generations"`
	// Behind counts the nodes that still present the old key or have not
	// learned the new one: for the node CA, nodes whose certificate an
	// older CA issued; for the kinds a daemon pins, nodes whose daemon has
	// not said, in a signed Hello, that it holds the current and next
	// keys (R21.2: a renewal issued is not a renewal the daemon
	// accepted); for the command-signing key, nodes whose newest
	// certificate predates the newest generation (they get the new
	// bundle with their next renewal).
	Behind int `json:"nodesBehind"`
	// BehindNodes names some of them (at most MaxBehindNamed), for the
	// operator to look at.
	BehindNodes []string `json:"behindNodes,omitempty"`
	// Nodes is how many live nodes were counted.
	Nodes int `json:"nodes"`
}

// MaxBehindNamed bounds KeyStatus.BehindNodes.
const MaxBehindNamed = 20

// ReloadMargin is how long after a generation is made pki status still
// counts a renewal as too early to have carried it: every replica has
// reloaded the keys by then (DefaultPoll, twice over).
const ReloadMargin = 2 * DefaultPoll

// Status reads every kind's generations and who is behind, as of now.
func Status(ctx context.Context, db *store.DB, now time.Time) ([]KeyStatus, error) {
	var rows []store.PKIKey
	var certs []store.LiveCert
	err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		if rows, err = tx.ListPKIKeys(ctx); err != nil {
			return err
		}
		certs, err = tx.LiveNodeCerts(ctx, now)
		return err
	})
	if err != nil {
		return nil, err
	}
	type live struct {
		node    string
		leaf    *x509.Certificate
		created time.Time
		acked   []string
	}
	leaves := make([]live, 0, len(certs))
	for _, c := range certs {
		if leaf, err := x509.ParseCertificate(c.DER); err == nil {
			leaves = append(leaves, live{c.NodeID, leaf, c.CreatedAt, c.PinsAck})
		}
	}
	var out []KeyStatus
	for _, kind := range append(slices.Clone(ca.Kinds), KindSecret) {
		ks := KeyStatus{Kind: kind, Nodes: len(leaves), Generations: []Generation{}}
		var newest time.Time
		var current *x509.Certificate
		var inForce []string // the current and next pins a daemon must hold
		for _, k := range kindRows(rows, kind) {
			g := Generation{Gen: k.Gen, State: k.State, CreatedAt: k.CreatedAt, ChangedAt: k.ChangedAt}
			if kind == KindSecret {
				g.Fingerprint = string(k.Cert)
			} else if pub, cert, err := ca.PublicKeyOfDER(kind, k.Cert); err == nil {
				g.Fingerprint, _ = pki.Pin(pub)
				if cert != nil {
					g.NotAfter = cert.NotAfter
				}
				if k.State == StateCurrent {
					current = cert
				}
			}
			if k.State == StateCurrent || k.State == StateNext {
				// Replicas pick a generation up within a poll: a node
				// renewed before then may not have been told.
				newest = later(newest, k.CreatedAt.Add(ReloadMargin))
				inForce = append(inForce, g.Fingerprint)
			}
			ks.Generations = append(ks.Generations, g)
		}
		for _, l := range leaves {
			var behind bool
			switch {
			case kind == ca.KindNodeCA:
				behind = current != nil && !bytes.Equal(l.leaf.AuthorityKeyId, current.SubjectKeyId)
			case ca.Pinned(kind):
				behind = len(ks.Generations) > 1 && !containsAll(l.acked, inForce)
			case kind != KindSecret:
				behind = len(ks.Generations) > 1 && l.created.Before(newest)
			}
			if behind {
				ks.Behind++
				if len(ks.BehindNodes) < MaxBehindNamed {
					ks.BehindNodes = append(ks.BehindNodes, l.node)
				}
			}
		}
		out = append(out, ks)
	}
	return out, nil
}

// containsAll reports whether every pin of want is in have.
func containsAll(have, want []string) bool {
	for _, w := range want {
		if !slices.Contains(have, w) {
			return false
		}
	}
	return true
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
