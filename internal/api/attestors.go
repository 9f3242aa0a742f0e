package api

import (
	"crypto/rand"
	"crypto/x509"
	"slices"

	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/join/attest"
	"github.com/better-compute/better-compute/internal/join/attest/discovery"
	jtattest "github.com/better-compute/better-compute/internal/join/attest/jointoken"
	tpmattest "github.com/better-compute/better-compute/internal/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/join/attest/x509pop"
	"github.com/better-compute/better-compute/internal/nodeident"
	"github.com/better-compute/better-compute/internal/wire"
)

// KnownAttestors are the attestor names a server can configure (the
// `[join] attestors` list).
var KnownAttestors = wire.Attestors

// DefaultAttestors are configured when Config.Attestors is empty.
var DefaultAttestors = []string{jtattest.Name}

// ValidateAttestors checks a configured attestor list: known names, each
// once.
func ValidateAttestors(names []string) error {
	for i, n := range names {
		if !slices.Contains(KnownAttestors, n) {
			return errs.New(errs.InvalidConfig, "config: join.attestors: unknown attestor %q (want some of %v)", n, KnownAttestors)
		}
		if slices.Contains(names[:i], n) {
			return errs.New(errs.InvalidConfig, "config: join.attestors: %q listed twice", n)
		}
	}
	return nil
}

// attestors builds JoinService's registry from the configured names
// (DefaultAttestors when none).
func attestors(names []string, core *nodeident.Core, tpmPools []tpmattest.Pool) (attest.Registry, error) {
	if len(names) == 0 {
		names = DefaultAttestors
	}
	if err := ValidateAttestors(names); err != nil {
		return nil, err
	}
	var nodeCA *x509.Certificate
	// The tpm challenge key: derived from the join-encryption key, which
	// every replica holds; random without a PKI (joins then answer
	// INVALID_CONFIG anyway).
	challengeKey := make([]byte, 32)
	_, _ = rand.Read(challengeKey)
	if b := core.Bundle(); b != nil {
		nodeCA = b.NodeCA
		if b.JoinEncryptionKey != nil {
			challengeKey = tpmattest.ChallengeKeyFrom(b.JoinEncryptionKey.D.Bytes())
		}
	}
	as := make([]attest.Attestor, 0, len(names))
	for _, n := range names {
		switch n {
		case jtattest.Name:
			as = append(as, jtattest.New())
		case x509pop.Name:
			as = append(as, x509pop.New(x509pop.Config{Core: core, NodeCA: nodeCA}))
		case discovery.Name:
			as = append(as, discovery.New())
		case tpmattest.Name:
			a, err := tpmattest.New(tpmattest.Config{Pools: tpmPools, ChallengeKey: challengeKey, Clock: core.Clock()})
			if err != nil {
				return nil, err
			}
			as = append(as, a)
		}
	}
	return attest.NewRegistry(as...)
}
