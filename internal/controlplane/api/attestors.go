package api

import (
	"crypto/rand"
	"crypto/x509"
	"slices"

	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/discovery"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/jointoken"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/x509pop"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// KnownAttestors are the attestor names a server can configure (the
// `[join] attestors` list).
var KnownAttestors = wire.Attestors

// DefaultAttestors are configured when Config.Attestors is empty.
var DefaultAttestors = []string{jointoken.Name}

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
func attestors(names []string, core *nodeident.Core, tpmPools []tpm.Pool) (attest.Registry, error) {
	if len(names) == 0 {
		names = DefaultAttestors
	}
	if err := ValidateAttestors(names); err != nil {
		return nil, err
	}
	// The live bundle's node CAs: a rotation reaches the attestor without a
	// restart (R16.1).
	// x509pop re-joins certificates of retired node CAs too (R21.1): the
	// identity core still refuses them for sessions.
	nodeCAs := func() []*x509.Certificate {
		if b := core.Bundle().Now(); b != nil {
			return append(slices.Clone(b.TrustedNodeCAs()), b.RetiredNodeCAs...)
		}
		return nil
	}
	// The tpm challenge key: derived from the join-encryption key, which
	// every replica holds; random without a PKI (joins then answer
	// INVALID_CONFIG anyway).
	challengeKey := make([]byte, 32)
	_, _ = rand.Read(challengeKey)
	if b := core.Bundle(); b != nil {
		if b.JoinEncryptionKey != nil {
			challengeKey = tpm.ChallengeKeyFrom(b.JoinEncryptionKey.D.Bytes())
		}
	}
	as := make([]attest.Attestor, 0, len(names))
	for _, n := range names {
		switch n {
		case jointoken.Name:
			as = append(as, jointoken.New())
		case x509pop.Name:
			as = append(as, x509pop.New(x509pop.Config{Core: core, NodeCAs: nodeCAs}))
		case discovery.Name:
			as = append(as, discovery.New())
		case tpm.Name:
			a, err := tpm.New(tpm.Config{Pools: tpmPools, ChallengeKey: challengeKey, Clock: core.Clock()})
			if err != nil {
				return nil, err
			}
			as = append(as, a)
		}
	}
	return attest.NewRegistry(as...)
}
