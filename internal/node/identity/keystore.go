package identity

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// PEM block types a node.key holds (R4.1, R9.1).
const (
	// PEMTypeSoftware is a PKCS#8 P-256 private key.
	PEMTypeSoftware = "PRIVATE KEY"
	// PEMTypeTPM is a TPM key record (TPM2B_PUBLIC + TPM2B_PRIVATE under the
	// owner hierarchy's SRK): the key itself never leaves the TPM.
	PEMTypeTPM = "TSS2 PRIVATE KEY"
)

// Key kinds, as RecordKind reports them.
const (
	KindSoftware = "software"
	KindTPM      = "tpm"
)

// KeyStore makes and reopens node keys. The software store keeps the key in
// node.key; a TPM store (R9.1) keeps it in the TPM and node.key holds only
// its record. Both give a crypto.Signer over an ECDSA P-256 key.
type KeyStore interface {
	// GenerateKey makes a new P-256 key and returns it with the record to
	// store in node.key (a PEM block).
	GenerateKey() (signer crypto.Signer, recordPEM []byte, err error)
	// LoadKey reopens the key a record describes.
	LoadKey(recordPEM []byte) (crypto.Signer, error)
}

// RecordKind returns KindSoftware or KindTPM from a node.key record's PEM
// type, or "" when it is neither. It does not parse the key.
func RecordKind(recordPEM []byte) string {
	block, _ := pem.Decode(recordPEM)
	if block == nil {
		return ""
	}
	switch block.Type {
	case PEMTypeSoftware:
		return KindSoftware
	case PEMTypeTPM:
		return KindTPM
	}
	return ""
}

// SoftwareKeys is the KeyStore without a TPM: node.key is the key itself, a
// PKCS#8 PEM. SECURITY: anyone who reads node.key is the node until its
// certificate expires, which is why Store writes it 0600 and refuses to load
// it otherwise.
type SoftwareKeys struct{}

// GenerateKey makes a P-256 key and returns it as a PKCS#8 PEM record.
func (SoftwareKeys) GenerateKey() (crypto.Signer, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate node key: %w", err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("marshal node key: %w", err)
	}
	return key, pem.EncodeToMemory(&pem.Block{Type: PEMTypeSoftware, Bytes: der}), nil
}

// LoadKey parses a PKCS#8 PEM record holding a P-256 key. A TPM record is
// refused with a message that says so, rather than as a damaged file.
func (SoftwareKeys) LoadKey(recordPEM []byte) (crypto.Signer, error) {
	block, rest := pem.Decode(recordPEM)
	if block == nil || len(bytes.TrimSpace(rest)) != 0 {
		return nil, errs.New(errs.InvalidConfig, "%s is not a single PEM block", KeyFile)
	}
	switch block.Type {
	case PEMTypeSoftware:
	case PEMTypeTPM:
		return nil, errs.New(errs.InvalidConfig, "%s holds a TPM key record, so the node key is in this machine's TPM: enable the TPM in config.toml ([tpm] mode) so bcd can open it", KeyFile)
	default:
		return nil, errs.New(errs.InvalidConfig, "%s holds a %q PEM block, want %q or %q", KeyFile, block.Type, PEMTypeSoftware, PEMTypeTPM)
	}
	if len(block.Headers) != 0 {
		return nil, errs.New(errs.InvalidConfig, "%s is an encrypted or annotated key; want a plain PKCS#8 key", KeyFile)
	}
	key, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "%s is not a PKCS#8 private key", KeyFile)
	}
	ec, ok := key.(*ecdsa.PrivateKey)
	if !ok || ec.Curve != elliptic.P256() {
		return nil, errs.New(errs.InvalidConfig, "%s is not an ECDSA P-256 key", KeyFile)
	}
	return ec, nil
}

// KeyAttester is a KeyStore whose keys the TPM's attestation key certifies
// (R9.2, R13.3): the TPM store.
type KeyAttester interface {
	KeyStore
	// AttestKey returns the AK's TPM2_Certify of signer's key over
	// sha256(csr), as a key_attestation, and the AK's TPM name.
	AttestKey(signer crypto.Signer, csr []byte) (attestation, akName []byte, err error)
}

// AttestorTPM joins with the TPM and no token (R9.2).
const AttestorTPM = wire.AttestorTPM
