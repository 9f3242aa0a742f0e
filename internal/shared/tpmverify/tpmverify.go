// Package tpmverify is what both sides know of the TPM without one (R9.2,
// R13.3). The control plane's tpm attestor and renewal use its checks; bcd
// reads its certificate statement and EK kinds. It checks a TPM2_Certify of a node key by an attestation key, the AK's and
// the node key's attributes, makes the credential challenge that proves an
// AK lives in an EK's TPM, decides whether an EK is trusted (a
// manufacturer-CA allow-list or an EK-hash allow-list), and owns the
// certificate statement urn:bc:tpm-ak:<nameAlg>:<digest> naming the AK. It
// touches no TPM and no store, and imports no process's code.
//
// Each check fails with a *Error whose Reason is what the server records;
// the machine only ever learns that it was refused.
package tpmverify

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math/big"
	"strings"

	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Error is a failed check; Reason is recorded server-side.
type Error struct {
	Reason string
	Err    error
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Reason + ": " + e.Err.Error()
	}
	return e.Reason
}

func (e *Error) Unwrap() error { return e.Err }

func fail(reason string, format string, a ...any) *Error {
	return &Error{Reason: reason, Err: fmt.Errorf(format, a...)}
}

// ReasonOf returns the reason of a *Error in err's chain, else "".
func ReasonOf(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Reason
	}
	return ""
}

// Refusal reasons.
const (
	ReasonKeyAttestationInvalid = "key-attestation-invalid"
	ReasonAKAttributes          = "ak-attributes"
	ReasonCertifySignature      = "certify-signature"
	ReasonCertifyInvalid        = "certify-invalid"
	ReasonCertifyCSR            = "certify-csr"
	ReasonNodeKeyName           = "node-key-name"
	ReasonNodeKeyNotFixedTPM    = "node-key-not-fixedtpm"
	ReasonNodeKeyAttributes     = "node-key-attributes"
	ReasonNodeKeyCSR            = "node-key-csr"
	ReasonEKInvalid             = "ek-invalid"
	ReasonEKCertInvalid         = "ek-cert-invalid"
	ReasonEKCertKey             = "ek-cert-key"
)

// StatementPrefix starts the statement naming the TPM attestation key that
// holds the node key (R7.2, R13.3).
const StatementPrefix = pki.StatementPrefix + "tpm-ak:"

// nameAlgs are the TPM name algorithms a statement spells.
var nameAlgs = map[tpm2.TPMAlgID]string{tpm2.TPMAlgSHA256: "sha256", tpm2.TPMAlgSHA384: "sha384"}

// Statement returns urn:bc:tpm-ak:<nameAlg>:<hex digest> for an AK's TPM
// name (the name algorithm's two bytes, then the digest).
func Statement(akName []byte) (string, error) {
	if len(akName) < 2 {
		return "", errors.New("a TPM name is at least two bytes")
	}
	alg := tpm2.TPMAlgID(uint16(akName[0])<<8 | uint16(akName[1]))
	spell, ok := nameAlgs[alg]
	if !ok {
		return "", fmt.Errorf("unsupported TPM name algorithm %#x", uint16(alg))
	}
	return StatementPrefix + spell + ":" + hex.EncodeToString(akName[2:]), nil
}

// ParseStatement returns the AK name a statement names; ok is false for a
// statement that is not a tpm-ak one or is malformed.
func ParseStatement(s string) (akName []byte, ok bool) {
	rest, found := strings.CutPrefix(s, StatementPrefix)
	if !found {
		return nil, false
	}
	spell, digest, found := strings.Cut(rest, ":")
	if !found {
		return nil, false
	}
	for alg, name := range nameAlgs {
		if name != spell {
			continue
		}
		d, err := hex.DecodeString(digest)
		h, _ := alg.Hash()
		if err != nil || len(d) != h.Size() || strings.ToLower(digest) != digest {
			return nil, false
		}
		return append([]byte{byte(alg >> 8), byte(alg)}, d...), true
	}
	return nil, false
}

// IsStatement reports whether s is a tpm-ak statement (well formed or not).
func IsStatement(s string) bool { return strings.HasPrefix(s, StatementPrefix) }

// KeyAttestation is a parsed key_attestation.
type KeyAttestation struct {
	AK, Key                *tpm2.TPMTPublic
	CertifyInfo, Signature []byte
}

// ParseKeyAttestation decodes a key_attestation.
func ParseKeyAttestation(b []byte) (*KeyAttestation, error) {
	var m agentv1.TPMKeyAttestation
	if len(b) == 0 || proto.Unmarshal(b, &m) != nil {
		return nil, fail(ReasonKeyAttestationInvalid, "not a TPMKeyAttestation")
	}
	ak, err := tpm2.Unmarshal[tpm2.TPMTPublic](m.GetAkPublic())
	if err != nil {
		return nil, fail(ReasonKeyAttestationInvalid, "AK public: %v", err)
	}
	key, err := tpm2.Unmarshal[tpm2.TPMTPublic](m.GetKeyPublic())
	if err != nil {
		return nil, fail(ReasonKeyAttestationInvalid, "key public: %v", err)
	}
	return &KeyAttestation{AK: ak, Key: key, CertifyInfo: m.GetCertifyInfo(), Signature: m.GetSignature()}, nil
}

// AKName returns the TPM name of a public area.
func AKName(pub *tpm2.TPMTPublic) ([]byte, error) {
	n, err := tpm2.ObjectName(pub)
	if err != nil {
		return nil, err
	}
	return n.Buffer, nil
}

// CheckAK checks an attestation key's attributes: a restricted signing key
// made in its TPM and never leaving it.
func CheckAK(ak *tpm2.TPMTPublic) error {
	a := ak.ObjectAttributes
	if !a.FixedTPM || !a.FixedParent || !a.SensitiveDataOrigin || !a.Restricted || !a.SignEncrypt || a.Decrypt {
		return fail(ReasonAKAttributes, "the AK is not a restricted, fixedTPM signing key")
	}
	if _, err := tpm2.Pub(*ak); err != nil {
		return fail(ReasonAKAttributes, "the AK public key: %v", err)
	}
	return nil
}

// Verify checks a key attestation for a CSR whose key is csrKey (R9.2,
// R13.3): the AK is a restricted fixedTPM signing key; it signed (ECDSA
// SHA-256) a TPM-generated certify whose qualifying data is sha256(csr) and
// whose certified name is the key's; the key is an unrestricted P-256
// signing key made in the TPM with fixedTPM, fixedParent and
// sensitiveDataOrigin, and is the CSR's key. It returns the AK's name.
func Verify(a *KeyAttestation, csr []byte, csrKey crypto.PublicKey) ([]byte, error) {
	if err := CheckAK(a.AK); err != nil {
		return nil, err
	}
	akPub, _ := tpm2.Pub(*a.AK)
	akEC, ok := akPub.(*ecdsa.PublicKey)
	if !ok {
		return nil, fail(ReasonAKAttributes, "the AK is not an ECDSA key")
	}
	sig, err := tpm2.Unmarshal[tpm2.TPMTSignature](a.Signature)
	if err != nil {
		return nil, fail(ReasonCertifySignature, "signature: %v", err)
	}
	ecs, err := sig.Signature.ECDSA()
	if err != nil || sig.SigAlg != tpm2.TPMAlgECDSA || ecs.Hash != tpm2.TPMAlgSHA256 {
		return nil, fail(ReasonCertifySignature, "not an ECDSA-SHA256 signature")
	}
	digest := sha256.Sum256(a.CertifyInfo)
	if !ecdsa.Verify(akEC, digest[:], new(big.Int).SetBytes(ecs.SignatureR.Buffer), new(big.Int).SetBytes(ecs.SignatureS.Buffer)) {
		return nil, fail(ReasonCertifySignature, "the AK did not sign this certify")
	}
	info, err := tpm2.Unmarshal[tpm2.TPMSAttest](a.CertifyInfo)
	if err != nil {
		return nil, fail(ReasonCertifyInvalid, "certify: %v", err)
	}
	if info.Magic != tpm2.TPMGeneratedValue || info.Type != tpm2.TPMSTAttestCertify {
		return nil, fail(ReasonCertifyInvalid, "not a TPM-generated certify")
	}
	if want := pki.CSRHash(csr); !bytes.Equal(info.ExtraData.Buffer, want) {
		return nil, fail(ReasonCertifyCSR, "the certify is for another CSR")
	}
	ci, err := info.Attested.Certify()
	if err != nil {
		return nil, fail(ReasonCertifyInvalid, "certify: %v", err)
	}
	keyName, err := tpm2.ObjectName(a.Key)
	if err != nil || !bytes.Equal(ci.Name.Buffer, keyName.Buffer) {
		return nil, fail(ReasonNodeKeyName, "the certify names another key")
	}
	if err := CheckNodeKey(a.Key, csrKey); err != nil {
		return nil, err
	}
	return AKName(a.AK)
}

// CheckNodeKey checks a node key's public area (R9.1): fixedTPM,
// fixedParent, sensitiveDataOrigin, an unrestricted P-256 signing key, and
// the CSR's key.
func CheckNodeKey(key *tpm2.TPMTPublic, csrKey crypto.PublicKey) error {
	a := key.ObjectAttributes
	if !a.FixedTPM {
		return fail(ReasonNodeKeyNotFixedTPM, "the node key may leave its TPM")
	}
	if !a.FixedParent || !a.SensitiveDataOrigin || !a.SignEncrypt || a.Restricted || a.Decrypt {
		return fail(ReasonNodeKeyAttributes, "the node key is not an unrestricted signing key made in the TPM")
	}
	pub, err := tpm2.Pub(*key)
	if err != nil {
		return fail(ReasonNodeKeyAttributes, "the node key: %v", err)
	}
	ec, ok := pub.(*ecdsa.PublicKey)
	if !ok || ec.Params().Name != "P-256" {
		return fail(ReasonNodeKeyAttributes, "the node key is not P-256")
	}
	if !ec.Equal(csrKey) {
		return fail(ReasonNodeKeyCSR, "the certified key is not the CSR's")
	}
	return nil
}

// ParseEK decodes an EK's TPMT_PUBLIC and checks it is an RSA-2048, P-256
// or P-384 restricted decryption key made in its TPM.
func ParseEK(b []byte) (*tpm2.TPMTPublic, error) {
	ek, err := tpm2.Unmarshal[tpm2.TPMTPublic](b)
	if err != nil {
		return nil, fail(ReasonEKInvalid, "EK public: %v", err)
	}
	a := ek.ObjectAttributes
	if KindOf(ek) == "" || !a.FixedTPM || !a.FixedParent || !a.Restricted || !a.Decrypt || a.SignEncrypt {
		return nil, fail(ReasonEKInvalid, "not an RSA-2048, P-256 or P-384 endorsement key")
	}
	if _, err := tpm2.Pub(*ek); err != nil {
		return nil, fail(ReasonEKInvalid, "EK public key: %v", err)
	}
	return ek, nil
}

// EKHash is how an EK is named in allow-lists and join requests: SHA-256
// of its public key's SubjectPublicKeyInfo (DER), what
// `openssl pkey -pubin -outform der | sha256sum` prints for the key in its
// certificate.
func EKHash(ek *tpm2.TPMTPublic) ([]byte, error) {
	pub, err := tpm2.Pub(*ek)
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(der)
	return sum[:], nil
}

// MakeCredential makes the challenge for an AK name under an EK
// (TPM2_MakeCredential's result, computed in software): only the TPM
// holding that EK, with that AK loaded, recovers secret.
func MakeCredential(rnd io.Reader, ek *tpm2.TPMTPublic, akName, secret []byte) (blob, encryptedSecret []byte, err error) {
	if rnd == nil {
		rnd = rand.Reader
	}
	enc, err := tpm2.ImportEncapsulationKey(ek)
	if err != nil {
		return nil, nil, fail(ReasonEKInvalid, "EK encapsulation key: %v", err)
	}
	return tpm2.CreateCredential(rnd, enc, akName, secret)
}

// EKKind is an endorsement key's algorithm.
type EKKind string

// The endorsement key kinds the tpm attestor accepts.
const (
	EKRSA2048 EKKind = "rsa-2048"
	EKP384    EKKind = "p-384"
	EKP256    EKKind = "p-256"
)

// KindOf names the EK kind of a public area, or "" when it is none of them.
func KindOf(pub *tpm2.TPMTPublic) EKKind {
	switch pub.Type {
	case tpm2.TPMAlgRSA:
		if d, err := pub.Parameters.RSADetail(); err == nil && d.KeyBits == 2048 {
			return EKRSA2048
		}
	case tpm2.TPMAlgECC:
		if d, err := pub.Parameters.ECCDetail(); err == nil {
			switch d.CurveID {
			case tpm2.TPMECCNistP256:
				return EKP256
			case tpm2.TPMECCNistP384:
				return EKP384
			}
		}
	}
	return ""
}
