package tpmdevice

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"slices"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// EKKind is an endorsement key's algorithm (tpmverify's, which the
// control plane checks EKs against).
type EKKind = tpmverify.EKKind

// The endorsement keys bcd uses, in the order DefaultEK prefers them.
const (
	EKRSA2048 = tpmverify.EKRSA2048
	EKP384    = tpmverify.EKP384
	EKP256    = tpmverify.EKP256
)

// ekSpec is where the TCG EK Credential Profile puts an EK kind: its
// persistent handle, its certificate's NV index and, for the low-range
// kinds, the template it is derived from.
type ekSpec struct {
	handle, certNV tpm2.TPMHandle
	template       *tpm2.TPMTPublic
}

var ekSpecs = map[EKKind]ekSpec{
	EKRSA2048: {handle: 0x81010001, certNV: 0x01C00002, template: &tpm2.RSAEKTemplate},
	EKP256:    {handle: 0x81010002, certNV: 0x01C0000A, template: &tpm2.ECCEKTemplate},
	// The high-range P-384 EK (swtpm_setup --ecc): used when persistent.
	EKP384: {handle: 0x81010016, certNV: 0x01C00016},
}

// EK is an endorsement key: its public area and, when the TPM holds one,
// its certificate (DER).
type EK struct {
	Kind   EKKind
	Public tpm2.TPMTPublic
	Cert   []byte
}

// PublicBytes is the EK's TPMT_PUBLIC, as sent to the server.
func (e *EK) PublicBytes() []byte { return tpm2.Marshal(e.Public) }

// KindOf is tpmverify.KindOf.
func KindOf(pub *tpm2.TPMTPublic) EKKind { return tpmverify.KindOf(pub) }

// handle is an object the TPM holds for an operation: persistent, or
// transient and flushed by the operation's end.
type handle struct {
	h    tpm2.TPMHandle
	name tpm2.TPM2BName
	pub  tpm2.TPMTPublic
}

// auth is h as the authorized handle of a command (the keys here have empty
// authorization).
func (h *handle) auth() tpm2.AuthHandle {
	return tpm2.AuthHandle{Handle: h.h, Name: h.name, Auth: tpm2.PasswordAuth(nil)}
}

// op is one operation on the TPM: it holds the TPM (its lock, and the
// connection of an on-demand TPM) and the transient objects loaded for it.
// Every operation is
//
//	o, err := t.begin()
//	if err != nil {
//		return err
//	}
//	defer o.end()
//
// and loads what it needs through o (primary, loadEK, load), so whatever
// it loaded is flushed on every path (handle hygiene, in the package doc).
type op struct {
	t      *TPM
	tpm    transport.TPM
	loaded []tpm2.TPMHandle // transient objects, oldest first
}

// begin takes the TPM for one operation, connecting when needed.
func (t *TPM) begin() (*op, error) {
	if err := t.acquire(); err != nil {
		return nil, err
	}
	return &op{t: t, tpm: t.t}, nil
}

// end flushes what the operation loaded, newest first, and lets the TPM go.
func (o *op) end() {
	for i := len(o.loaded) - 1; i >= 0; i-- {
		_, _ = tpm2.FlushContext{FlushHandle: o.loaded[i]}.Execute(o.tpm)
	}
	o.loaded = nil
	o.t.unlock()
}

// flush flushes h now, freeing its slot for the rest of the operation (swtpm
// has three). A persistent handle is left alone.
func (o *op) flush(h *handle) {
	if i := slices.Index(o.loaded, h.h); i >= 0 {
		_, _ = tpm2.FlushContext{FlushHandle: h.h}.Execute(o.tpm)
		o.loaded = slices.Delete(o.loaded, i, i+1)
	}
}

// transient records a transient object the operation loaded, for end.
func (o *op) transient(h tpm2.TPMHandle, name tpm2.TPM2BName, pub tpm2.TPMTPublic) *handle {
	o.loaded = append(o.loaded, h)
	return &handle{h: h, name: name, pub: pub}
}

// readPublic returns a persistent object.
func (o *op) readPublic(h tpm2.TPMHandle) (*handle, error) {
	rsp, err := tpm2.ReadPublic{ObjectHandle: h}.Execute(o.tpm)
	if err != nil {
		return nil, err
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, err
	}
	return &handle{h: h, name: rsp.Name, pub: *pub}, nil
}

// primary derives the primary key of hierarchy from tmpl (the same seed
// and template derive the same key every time).
func (o *op) primary(hierarchy tpm2.TPMHandle, tmpl tpm2.TPMTPublic) (*handle, error) {
	rsp, err := tpm2.CreatePrimary{
		PrimaryHandle: tpm2.AuthHandle{Handle: hierarchy, Auth: tpm2.PasswordAuth(nil)},
		InPublic:      tpm2.New2B(tmpl),
	}.Execute(o.tpm)
	if err != nil {
		return nil, err
	}
	h := o.transient(rsp.ObjectHandle, rsp.Name, tpm2.TPMTPublic{})
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, err
	}
	h.pub = *pub
	return h, nil
}

// ak derives the attestation key.
func (o *op) ak() (*handle, error) {
	h, err := o.primary(tpm2.TPMRHEndorsement, AKTemplate)
	if err != nil {
		return nil, fmt.Errorf("create the AK: %w", err)
	}
	return h, nil
}

// loadEK returns the EK of kind: its persistent handle when the TPM has
// one, else the primary its template derives.
func (o *op) loadEK(kind EKKind) (*handle, error) {
	spec, ok := ekSpecs[kind]
	if !ok {
		return nil, fmt.Errorf("unknown EK kind %q", kind)
	}
	if h, err := o.readPublic(spec.handle); err == nil && KindOf(&h.pub) == kind {
		return h, nil
	}
	if spec.template == nil {
		return nil, fmt.Errorf("this TPM has no persistent %s EK", kind)
	}
	h, err := o.primary(tpm2.TPMRHEndorsement, *spec.template)
	if err != nil {
		return nil, fmt.Errorf("create the %s EK: %w", kind, err)
	}
	return h, nil
}

// EK returns the endorsement key of kind with its certificate when the TPM
// holds one.
func (t *TPM) EK(kind EKKind) (*EK, error) {
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	h, err := o.loadEK(kind)
	if err != nil {
		return nil, err
	}
	cert, err := o.readNV(ekSpecs[kind].certNV)
	if err != nil {
		cert = nil // no certificate: the EK-hash allow-list or enrollment
	}
	return &EK{Kind: kind, Public: h.pub, Cert: trimDER(cert)}, nil
}

// DefaultEK returns the EK bcd uses: the first kind, in the order RSA-2048,
// P-384, P-256, that the TPM keeps persistent or has a certificate for;
// else the RSA-2048 EK its template derives.
func (t *TPM) DefaultEK() (*EK, error) {
	for _, k := range []EKKind{EKRSA2048, EKP384, EKP256} {
		spec := ekSpecs[k]
		o, err := t.begin()
		if err != nil {
			return nil, err
		}
		h, perr := o.readPublic(spec.handle)
		_, nerr := tpm2.NVReadPublic{NVIndex: spec.certNV}.Execute(o.tpm)
		o.end()
		if (perr == nil && KindOf(&h.pub) == k) || nerr == nil {
			return t.EK(k)
		}
	}
	return t.EK(EKRSA2048)
}

// nvChunk is what one NV_Read asks for (TPMs allow at least 512 bytes).
const nvChunk = 512

// readNV reads a whole NV index with owner authorization.
func (o *op) readNV(index tpm2.TPMHandle) ([]byte, error) {
	rp, err := tpm2.NVReadPublic{NVIndex: index}.Execute(o.tpm)
	if err != nil {
		return nil, err
	}
	pub, err := rp.NVPublic.Contents()
	if err != nil {
		return nil, err
	}
	var out []byte
	for off := 0; off < int(pub.DataSize); off += nvChunk {
		n := min(nvChunk, int(pub.DataSize)-off)
		rsp, err := tpm2.NVRead{
			AuthHandle: tpm2.AuthHandle{Handle: tpm2.TPMRHOwner, Auth: tpm2.PasswordAuth(nil)},
			NVIndex:    tpm2.NamedHandle{Handle: index, Name: rp.NVName},
			Size:       uint16(n),
			Offset:     uint16(off),
		}.Execute(o.tpm)
		if err != nil {
			return nil, err
		}
		out = append(out, rsp.Data.Buffer...)
	}
	return out, nil
}

// trimDER cuts the padding an NV index may hold after a DER certificate.
func trimDER(b []byte) []byte {
	var raw asn1.RawValue
	rest, err := asn1.Unmarshal(b, &raw)
	if err != nil {
		return b
	}
	return b[:len(b)-len(rest)]
}

// eccSigning is an ECC P-256 signing key's parameters with ECDSA-SHA256.
var eccSigning = tpm2.NewTPMUPublicParms(tpm2.TPMAlgECC, &tpm2.TPMSECCParms{
	Scheme: tpm2.TPMTECCScheme{
		Scheme:  tpm2.TPMAlgECDSA,
		Details: tpm2.NewTPMUAsymScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSigSchemeECDSA{HashAlg: tpm2.TPMAlgSHA256}),
	},
	CurveID: tpm2.TPMECCNistP256,
})

// AKTemplate is the attestation key: a restricted P-256 signing key created
// as an endorsement-hierarchy primary, so the same TPM derives the same AK
// (and AK name) every time and no AK file is needed.
var AKTemplate = tpm2.TPMTPublic{
	Type:    tpm2.TPMAlgECC,
	NameAlg: tpm2.TPMAlgSHA256,
	ObjectAttributes: tpm2.TPMAObject{
		FixedTPM: true, FixedParent: true, SensitiveDataOrigin: true, UserWithAuth: true,
		Restricted: true, SignEncrypt: true, NoDA: true,
	},
	Parameters: eccSigning,
	Unique: tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: []byte("better-compute attestation key")},
	}),
}

// NodeKeyTemplate is a node key (R9.1): P-256, unrestricted signing,
// fixedTPM, fixedParent and sensitiveDataOrigin (made in this TPM and never
// leaving it), adminWithPolicy clear so TPM2_Certify may use it.
var NodeKeyTemplate = tpm2.TPMTPublic{
	Type:    tpm2.TPMAlgECC,
	NameAlg: tpm2.TPMAlgSHA256,
	ObjectAttributes: tpm2.TPMAObject{
		FixedTPM: true, FixedParent: true, SensitiveDataOrigin: true, UserWithAuth: true,
		SignEncrypt: true, NoDA: true,
	},
	Parameters: eccSigning,
	Unique:     tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{}),
}

// AK is the attestation key's public area and TPM name.
type AK struct {
	Public tpm2.TPMTPublic
	Name   []byte
}

// PublicBytes is the AK's TPMT_PUBLIC.
func (a *AK) PublicBytes() []byte { return tpm2.Marshal(a.Public) }

// AK derives the attestation key and returns its public area and name.
func (t *TPM) AK() (*AK, error) {
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	h, err := o.ak()
	if err != nil {
		return nil, err
	}
	return &AK{Public: h.pub, Name: h.name.Buffer}, nil
}

// SRKTemplate is the parent of node keys: the owner hierarchy's ECC P-256
// storage key as tpm2-openssl and tpm2-tools derive it for a key whose
// record names the owner hierarchy (TCG's ECC SRK template with an empty
// unique field), so `openssl pkey -provider tpm2 -in node.key` loads
// node.key (R20.3).
var SRKTemplate = func() tpm2.TPMTPublic {
	t := tpm2.ECCSRKTemplate
	t.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{})
	return t
}()

// legacySRKTemplate is the parent of node keys made before SRKTemplate:
// go-tpm's ECC SRK template (a unique field of two 32-byte zero buffers).
// Those keys still load (load tries it second); new keys never use it.
var legacySRKTemplate = tpm2.ECCSRKTemplate

// srk derives the owner hierarchy's storage root key from tmpl.
func (o *op) srk(tmpl tpm2.TPMTPublic) (*handle, error) {
	h, err := o.primary(tpm2.TPMRHOwner, tmpl)
	if err != nil {
		return nil, fmt.Errorf("create the SRK: %w", err)
	}
	return h, nil
}

// Key is a key held in the TPM under the SRK: a crypto.Signer (ECDSA P-256,
// SHA-256 digests) whose record reloads it.
type Key struct {
	tpm     *TPM
	public  tpm2.TPMTPublic
	private []byte // TPM2B_PRIVATE's buffer, opaque outside the TPM
	pub     *ecdsa.PublicKey
	// legacy: the key was made under legacySRKTemplate (found at its
	// first load), so later loads go there first.
	legacy bool
}

// NewNodeKey makes a node key (NodeKeyTemplate) under the SRK.
func (t *TPM) NewNodeKey() (*Key, error) { return t.CreateKey(NodeKeyTemplate) }

// CreateKey makes a P-256 signing key from tmpl under the SRK. Node keys
// use NodeKeyTemplate; tests make keys the server must refuse.
func (t *TPM) CreateKey(tmpl tpm2.TPMTPublic) (*Key, error) {
	return t.createKeyUnder(SRKTemplate, tmpl)
}

// createKeyUnder is CreateKey under the SRK made from parent.
func (t *TPM) createKeyUnder(parent, tmpl tpm2.TPMTPublic) (*Key, error) {
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	srk, err := o.srk(parent)
	if err != nil {
		return nil, err
	}
	rsp, err := tpm2.Create{
		ParentHandle: srk.auth(),
		InPublic:     tpm2.New2B(tmpl),
	}.Execute(o.tpm)
	if err != nil {
		return nil, fmt.Errorf("create a key in the TPM: %w", err)
	}
	pub, err := rsp.OutPublic.Contents()
	if err != nil {
		return nil, err
	}
	return t.newKey(*pub, rsp.OutPrivate.Buffer)
}

func (t *TPM) newKey(public tpm2.TPMTPublic, private []byte) (*Key, error) {
	pk, err := tpm2.Pub(public)
	if err != nil {
		return nil, fmt.Errorf("read the key's public area: %w", err)
	}
	ec, ok := pk.(*ecdsa.PublicKey)
	if !ok || ec.Curve != elliptic.P256() {
		return nil, errors.New("the TPM key is not an ECDSA P-256 key")
	}
	return &Key{tpm: t, public: public, private: private, pub: ec}, nil
}

// load loads k under a fresh SRK, which it flushes at once: k then holds
// one slot until the operation ends. A key made under the legacy SRK is
// found there when the standard one refuses it (a TPM whose seed is the
// same derives both), and remembered.
func (o *op) load(k *Key) (*handle, error) {
	order := []bool{k.legacy, !k.legacy} // legacy parent or not, in turn
	var first error
	for _, legacy := range order {
		parent := SRKTemplate
		if legacy {
			parent = legacySRKTemplate
		}
		h, err := o.loadUnder(parent, k)
		if err == nil {
			k.legacy = legacy
			return h, nil
		}
		if first == nil {
			first = err
		}
	}
	return nil, fmt.Errorf("load the node key into the TPM (was the TPM cleared or replaced?): %w", first)
}

func (o *op) loadUnder(parent tpm2.TPMTPublic, k *Key) (*handle, error) {
	srk, err := o.srk(parent)
	if err != nil {
		return nil, err
	}
	defer o.flush(srk)
	rsp, err := tpm2.Load{
		ParentHandle: srk.auth(),
		InPrivate:    tpm2.TPM2BPrivate{Buffer: k.private},
		InPublic:     tpm2.New2B(k.public),
	}.Execute(o.tpm)
	if err != nil {
		return nil, err
	}
	return o.transient(rsp.ObjectHandle, rsp.Name, k.public), nil
}

// Public implements crypto.Signer.
func (k *Key) Public() crypto.PublicKey { return k.pub }

// PublicArea is the key's TPMT_PUBLIC.
func (k *Key) PublicArea() tpm2.TPMTPublic { return k.public }

// Sign implements crypto.Signer: an ECDSA signature (ASN.1 DER) over a
// SHA-256 digest, made in the TPM.
func (k *Key) Sign(_ io.Reader, digest []byte, opts crypto.SignerOpts) ([]byte, error) {
	if opts.HashFunc() != crypto.SHA256 || len(digest) != 32 {
		return nil, errors.New("the TPM node key signs SHA-256 digests only")
	}
	o, err := k.tpm.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	h, err := o.load(k)
	if err != nil {
		return nil, err
	}
	rsp, err := tpm2.Sign{
		KeyHandle: h.auth(),
		Digest:    tpm2.TPM2BDigest{Buffer: digest},
		InScheme: tpm2.TPMTSigScheme{
			Scheme:  tpm2.TPMAlgECDSA,
			Details: tpm2.NewTPMUSigScheme(tpm2.TPMAlgECDSA, &tpm2.TPMSSchemeHash{HashAlg: tpm2.TPMAlgSHA256}),
		},
		Validation: tpm2.TPMTTKHashCheck{Tag: tpm2.TPMSTHashCheck, Hierarchy: tpm2.TPMRHNull},
	}.Execute(o.tpm)
	if err != nil {
		return nil, fmt.Errorf("sign with the TPM node key: %w", err)
	}
	sig, err := rsp.Signature.Signature.ECDSA()
	if err != nil {
		return nil, err
	}
	return asn1.Marshal(struct{ R, S *big.Int }{
		new(big.Int).SetBytes(sig.SignatureR.Buffer), new(big.Int).SetBytes(sig.SignatureS.Buffer),
	})
}

// KeyAttestation is the AK's TPM2_Certify of a key: the AK and key public
// areas (TPMT_PUBLIC), the TPMS_ATTEST bytes as the TPM produced them and
// the AK's TPMT_SIGNATURE over them.
type KeyAttestation struct {
	AKPublic, KeyPublic, CertifyInfo, Signature []byte
}

// Marshal encodes a key attestation for the wire (agentv1.TPMKeyAttestation,
// which tpmverify.ParseKeyAttestation reads).
func (a *KeyAttestation) Marshal() ([]byte, error) {
	return proto.Marshal(&agentv1.TPMKeyAttestation{AkPublic: a.AKPublic, KeyPublic: a.KeyPublic, CertifyInfo: a.CertifyInfo, Signature: a.Signature})
}

// Certify has the AK certify k with qualifying data (sha256 of the CSR).
func (t *TPM) Certify(k *Key, qualifying []byte) (*KeyAttestation, error) {
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	ak, err := o.ak()
	if err != nil {
		return nil, err
	}
	h, err := o.load(k)
	if err != nil {
		return nil, err
	}
	rsp, err := tpm2.Certify{
		ObjectHandle:   h.auth(),
		SignHandle:     ak.auth(),
		QualifyingData: tpm2.TPM2BData{Buffer: qualifying},
		InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull},
	}.Execute(o.tpm)
	if err != nil {
		return nil, fmt.Errorf("certify the node key: %w", err)
	}
	return &KeyAttestation{
		AKPublic: tpm2.Marshal(ak.pub), KeyPublic: tpm2.Marshal(k.public),
		CertifyInfo: rsp.CertifyInfo.Bytes(), Signature: tpm2.Marshal(rsp.Signature),
	}, nil
}

// ActivateCredential recovers the secret of a credential made for this
// TPM's EK of kind and its AK (tpm2.CreateCredential on the server). Only
// the TPM holding both can.
func (t *TPM) ActivateCredential(kind EKKind, credentialBlob, encryptedSecret []byte) ([]byte, error) {
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	ek, err := o.loadEK(kind)
	if err != nil {
		return nil, err
	}
	ak, err := o.ak()
	if err != nil {
		return nil, err
	}
	var ekAuth tpm2.Session
	if ek.pub.ObjectAttributes.UserWithAuth {
		ekAuth = tpm2.PasswordAuth(nil)
	} else {
		// The TCG EK templates authorize with PolicySecret(endorsement).
		sess, closeSess, err := tpm2.PolicySession(o.tpm, ek.pub.NameAlg, 16)
		if err != nil {
			return nil, fmt.Errorf("start the EK policy session: %w", err)
		}
		defer func() { _ = closeSess() }()
		if _, err := (tpm2.PolicySecret{
			AuthHandle:    tpm2.AuthHandle{Handle: tpm2.TPMRHEndorsement, Auth: tpm2.PasswordAuth(nil)},
			PolicySession: sess.Handle(),
			NonceTPM:      sess.NonceTPM(),
		}).Execute(o.tpm); err != nil {
			return nil, fmt.Errorf("authorize the EK: %w", err)
		}
		ekAuth = sess
	}
	rsp, err := tpm2.ActivateCredential{
		ActivateHandle: ak.auth(),
		KeyHandle:      tpm2.AuthHandle{Handle: ek.h, Name: ek.name, Auth: ekAuth},
		CredentialBlob: tpm2.TPM2BIDObject{Buffer: credentialBlob},
		Secret:         tpm2.TPM2BEncryptedSecret{Buffer: encryptedSecret},
	}.Execute(o.tpm)
	if err != nil {
		return nil, fmt.Errorf("activate the credential: %w", err)
	}
	return rsp.CertInfo.Buffer, nil
}

// PEMTypeRecord is the PEM type of a key record.
const PEMTypeRecord = "TSS2 PRIVATE KEY"

// oidLoadableKey is TCG's loadable-key type (TPM2B_PUBLIC + TPM2B_PRIVATE
// under a parent).
var oidLoadableKey = asn1.ObjectIdentifier{2, 23, 133, 10, 1, 3}

// parentOwner is the record's parent: the owner hierarchy, whose SRK bcd,
// tpm2-openssl and tpm2-tools re-derive from SRKTemplate.
const parentOwner = 0x40000001

// tssKey is the "TSS2 PRIVATE KEY" ASN.1 structure.
type tssKey struct {
	Type      asn1.ObjectIdentifier
	EmptyAuth bool `asn1:"explicit,tag:0,optional"`
	Parent    int64
	Pub       []byte
	Priv      []byte
}

// Record returns k's record, a "TSS2 PRIVATE KEY" PEM: what node.key holds.
func (k *Key) Record() ([]byte, error) {
	der, err := asn1.Marshal(tssKey{
		Type: oidLoadableKey, EmptyAuth: true, Parent: parentOwner,
		Pub:  tpm2.Marshal(tpm2.New2B(k.public)),
		Priv: tpm2.Marshal(tpm2.TPM2BPrivate{Buffer: k.private}),
	})
	if err != nil {
		return nil, fmt.Errorf("marshal the key record: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: PEMTypeRecord, Bytes: der}), nil
}

// LoadKey reopens the key a record describes, and loads it once to check
// that this TPM still holds its parent (a cleared or replaced TPM fails
// here, and the node must join again).
func (t *TPM) LoadKey(recordPEM []byte) (*Key, error) {
	block, _ := pem.Decode(recordPEM)
	if block == nil || block.Type != PEMTypeRecord {
		return nil, fmt.Errorf("not a %q PEM block", PEMTypeRecord)
	}
	var rec tssKey
	if rest, err := asn1.Unmarshal(block.Bytes, &rec); err != nil || len(rest) != 0 {
		return nil, errors.New("the TPM key record is not a TSS2 key")
	}
	if !rec.Type.Equal(oidLoadableKey) || rec.Parent != parentOwner {
		return nil, fmt.Errorf("the TPM key record is of type %v under parent %#x, want a loadable key under the owner hierarchy", rec.Type, rec.Parent)
	}
	pub2b, err := tpm2.Unmarshal[tpm2.TPM2BPublic](rec.Pub)
	if err != nil {
		return nil, fmt.Errorf("the TPM key record's public area: %w", err)
	}
	pub, err := pub2b.Contents()
	if err != nil {
		return nil, fmt.Errorf("the TPM key record's public area: %w", err)
	}
	priv, err := tpm2.Unmarshal[tpm2.TPM2BPrivate](rec.Priv)
	if err != nil {
		return nil, fmt.Errorf("the TPM key record's private area: %w", err)
	}
	k, err := t.newKey(*pub, priv.Buffer)
	if err != nil {
		return nil, err
	}
	o, err := t.begin()
	if err != nil {
		return nil, err
	}
	defer o.end()
	if _, err := o.load(k); err != nil {
		return nil, err
	}
	return k, nil
}

// TransientHandles counts the transient objects loaded in the TPM: zero
// between operations (handle hygiene).
func (t *TPM) TransientHandles() (int, error) {
	o, err := t.begin()
	if err != nil {
		return 0, err
	}
	defer o.end()
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: uint32(tpm2.TPMHTTransient) << 24, PropertyCount: 64}.Execute(o.tpm)
	if err != nil {
		return 0, err
	}
	h, err := rsp.CapabilityData.Data.Handles()
	if err != nil {
		return 0, err
	}
	return len(h.Handle), nil
}
