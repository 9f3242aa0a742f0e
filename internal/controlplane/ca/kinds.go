package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// The kinds of key in a bundle, as rotation names them (R16.1). The three
// a daemon pins share pki's names.
const (
	KindNodeCA         = "node-ca"
	KindServingCA      = pki.KindServingCA
	KindCommandSigning = "command-signing"
	KindJoinSigning    = pki.KindJoinSigning
	KindJoinEncryption = pki.KindJoinEncryption
)

// Kinds lists every kind, in the order status and rotation show them.
var Kinds = []string{KindNodeCA, KindServingCA, KindJoinSigning, KindJoinEncryption, KindCommandSigning}

// Pinned reports whether daemons pin keys of kind (and so learn its next
// key only from a statement its current key signs).
func Pinned(kind string) bool {
	return kind == KindServingCA || kind == KindJoinSigning || kind == KindJoinEncryption
}

// ValidKind checks kind names a key of the bundle.
func ValidKind(kind string) error {
	for _, k := range Kinds {
		if k == kind {
			return nil
		}
	}
	return errs.Invalid("key", "%q is not a key of the machine PKI (one of node-ca, serving-ca, join-signing, join-encryption, command-signing)", kind)
}

// KeyOf returns the current key of kind: its certificate's DER (the
// SubjectPublicKeyInfo DER for join-encryption, which has no certificate)
// and its private key.
func (b *Bundle) KeyOf(kind string) (der []byte, key crypto.Signer) {
	switch kind {
	case KindNodeCA:
		return b.NodeCA.Raw, b.NodeCAKey
	case KindServingCA:
		return b.ServingCA.Raw, b.ServingCAKey
	case KindCommandSigning:
		return b.CommandSigningCert.Raw, b.CommandSigningKey
	case KindJoinSigning:
		return b.JoinSigningCert.Raw, b.JoinSigningKey
	case KindJoinEncryption:
		spki, _ := x509.MarshalPKIXPublicKey(&b.JoinEncryptionKey.PublicKey)
		return spki, b.JoinEncryptionKey
	}
	return nil, nil
}

// NewKeyOf makes generation gen of kind for trustDomain, valid from now:
// its DER (as KeyOf) and private key.
func NewKeyOf(kind, trustDomain string, gen int64, now time.Time) ([]byte, crypto.Signer, error) {
	if err := ValidKind(kind); err != nil {
		return nil, nil, err
	}
	if kind == KindJoinEncryption {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, nil, fmt.Errorf("make join-encryption key: %w", err)
		}
		spki, err := x509.MarshalPKIXPublicKey(&k.PublicKey)
		return spki, k, err
	}
	names := map[string]string{KindNodeCA: "node CA", KindServingCA: "serving CA", KindCommandSigning: "command signing", KindJoinSigning: "join signing"}
	isCA := kind == KindNodeCA || kind == KindServingCA
	cert, key, err := newSelfSigned(fmt.Sprintf("better-compute %s %s (generation %d)", names[kind], trustDomain, gen), isCA, now)
	if err != nil {
		return nil, nil, fmt.Errorf("make %s: %w", kind, err)
	}
	return cert.Raw, key, nil
}

// PublicKeyOfDER returns the public key in a KeyOf DER of kind.
func PublicKeyOfDER(kind string, der []byte) (*ecdsa.PublicKey, *x509.Certificate, error) {
	if kind == KindJoinEncryption {
		k, err := pki.ParseP256SPKI(der)
		return k, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse %s certificate: %w", kind, err)
	}
	k, ok := cert.PublicKey.(*ecdsa.PublicKey)
	if !ok || !pki.IsP256(k) {
		return nil, nil, fmt.Errorf("%s certificate: not an ECDSA P-256 key", kind)
	}
	return k, cert, nil
}
