package ca

import (
	"crypto/x509"
	"strconv"
	"strings"
)

// NodeCAGeneration is the rotation generation of a node CA: the N of the
// "(generation N)" its subject ends with (NewKeyOf), 1 for the CA pki init
// made, which names none.
func NodeCAGeneration(cert *x509.Certificate) int64 {
	cn := cert.Subject.CommonName
	rest, ok := strings.CutSuffix(cn, ")")
	if i := strings.LastIndex(rest, "(generation "); ok && i >= 0 {
		if n, err := strconv.ParseInt(rest[i+len("(generation "):], 10, 64); err == nil && n > 0 {
			return n
		}
	}
	return 1
}

// BundleSequence is the spiffe_sequence of the node CAs this bundle trusts
// (R20.2): the lowest plus the highest generation among them. It goes up at
// each step of a rotation that changes the set: {N} is 2N, preparing N+1
// makes {N, N+1} 2N+1, retiring N leaves {N+1}, 2N+2. Activation only
// reorders the set and keeps the number. A rollback of a prepared CA is
// the one step that lowers it (back to 2N), as the set is the earlier one
// again.
func (b *Bundle) BundleSequence() uint64 {
	lo, hi := int64(0), int64(0)
	for i, c := range b.TrustedNodeCAs() {
		g := NodeCAGeneration(c)
		if i == 0 || g < lo {
			lo = g
		}
		if i == 0 || g > hi {
			hi = g
		}
	}
	return uint64(lo + hi)
}
