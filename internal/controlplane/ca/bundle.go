package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/pki"

	"github.com/go-jose/go-jose/v4"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// BundleVersion is the version written to bundle.json.
const BundleVersion = 1

// File names inside a bundle directory. Keys are encrypted PEM (0600), the
// rest public (0644).
const (
	FileManifest           = "bundle.json"
	FileNodeCACert         = "node-ca.crt"
	FileNodeCAKey          = "node-ca.key"
	FileServingCACert      = "serving-ca.crt"
	FileServingCAKey       = "serving-ca.key"
	FileCommandSigningCert = "command-signing.crt"
	FileCommandSigningKey  = "command-signing.key"
	FileJoinSigningCert    = "join-signing.crt"
	FileJoinSigningKey     = "join-signing.key"
	FileJoinEncryptionKey  = "join-encryption.key"
	// FileJoinEncryptionJWK is the public encryption key as a JWK, the file
	// install scripts copy to /etc/bcd/join-encryption.jwk. Load checks it
	// matches the private key.
	FileJoinEncryptionJWK = "join-encryption.jwk"
)

// Lifetimes of what Init makes. CAs and the JoinService keys live ten years;
// rotation is a new bundle.
const (
	caLifetime = 10 * 365 * 24 * time.Hour
	// backdate covers clock skew between the issuer and the machines that
	// verify (bcd hosts often have unsynchronized clocks at first boot).
	backdate = 5 * time.Minute
)

// Manifest is bundle.json.
type Manifest struct {
	Version     int       `json:"version"`
	TrustDomain string    `json:"trustDomain"`
	CreatedAt   time.Time `json:"createdAt"`
}

// Bundle is the machine PKI of one deployment: every certificate and private
// key JoinService, the gateway and command signing need. All keys are ECDSA
// P-256.
type Bundle struct {
	// TrustDomain is the SPIFFE trust domain of node identities.
	TrustDomain string
	CreatedAt   time.Time

	// NodeCA signs node client certificates (SignNodeCert); the gateway
	// verifies node sessions against it.
	NodeCA    *x509.Certificate
	NodeCAKey crypto.Signer

	// ServingCA signs gateway certificates (IssueGateway). bcd pins its key
	// (serving_ca_spki_pin); api verifies gateway client certificates
	// against it.
	ServingCA    *x509.Certificate
	ServingCAKey crypto.Signer

	// CommandSigningCert is the command-signing trust bundle sent to nodes in
	// the join response; CommandSigningKey signs commands (SignPurpose).
	CommandSigningCert *x509.Certificate
	CommandSigningKey  crypto.Signer

	// JoinSigningCert is the well-known document's signingCertificate;
	// JoinSigningKey signs join responses (SignResponse). bcd pins its key
	// (join_signing_key_pin).
	JoinSigningCert *x509.Certificate
	JoinSigningKey  crypto.Signer

	// JoinEncryptionKey opens sealed join tokens (Open). bcd pins its public
	// key (join_encryption_key_pin).
	JoinEncryptionKey *ecdsa.PrivateKey

	// While a key rotates (R16.1, internal/controlplane/rotation), what is
	// accepted besides the keys above: the next key (prepared) and the
	// previous one (activated over, not yet retired). Each list starts with
	// the current key; a bundle that never rotated leaves them nil and the
	// accessors below answer with the current key alone.
	NodeCAs       []*x509.Certificate
	ServingCAs    []*x509.Certificate
	CommandCerts  []*x509.Certificate
	OpenKeys      []*ecdsa.PrivateKey
	KeyStatements []string
	// RetiredNodeCAs are the node CAs a rotation retired (R21.1). A
	// certificate one of them issued, still byte for byte a node_certs
	// row, may renew or re-join by x509pop, never open a session: a node
	// offline through a node-CA rotation comes back onto the current CA
	// by itself. The API trusts a node certificate only through its row
	// and the proof of its key, so an old CA's key, leaked or not, adds
	// nothing here; external verifiers (the SPIFFE bundle) no longer see
	// these CAs.
	RetiredNodeCAs []*x509.Certificate
	live           *Live
}

// Live is the current bundle of a deployment whose keys can rotate: the
// rotation package swaps it when the database says a key changed, and every
// holder of the startup bundle reads the newest through Bundle.Now.
type Live struct{ p atomic.Pointer[Bundle] }

// NewLive returns a Live holding b, and makes b follow it.
func NewLive(b *Bundle) *Live {
	l := &Live{}
	l.Set(b)
	b.live = l
	return l
}

// Set makes b the current bundle.
func (l *Live) Set(b *Bundle) {
	b.live = l
	l.p.Store(b)
}

// Now returns the newest bundle: b itself unless b follows a Live. Every
// signing and verifying path calls it once per operation and uses that one
// snapshot throughout, so an operation never mixes two generations.
func (b *Bundle) Now() *Bundle {
	if b == nil || b.live == nil {
		return b
	}
	return b.live.p.Load()
}

// TrustedNodeCAs returns the node CAs a node certificate may chain to.
func (b *Bundle) TrustedNodeCAs() []*x509.Certificate {
	if len(b.NodeCAs) > 0 {
		return b.NodeCAs
	}
	return []*x509.Certificate{b.NodeCA}
}

// TrustedServingCAs returns the serving CAs a gateway certificate may chain
// to.
func (b *Bundle) TrustedServingCAs() []*x509.Certificate {
	if len(b.ServingCAs) > 0 {
		return b.ServingCAs
	}
	return []*x509.Certificate{b.ServingCA}
}

// CommandBundle returns the DER certificates whose keys may sign commands,
// the join answer's command_bundle.
func (b *Bundle) CommandBundle() [][]byte {
	certs := b.CommandCerts
	if len(certs) == 0 {
		certs = []*x509.Certificate{b.CommandSigningCert}
	}
	out := make([][]byte, len(certs))
	for i, c := range certs {
		out[i] = c.Raw
	}
	return out
}

// OpeningKeys returns the join-encryption keys a seal may be made to.
func (b *Bundle) OpeningKeys() []*ecdsa.PrivateKey {
	if len(b.OpenKeys) > 0 {
		return b.OpenKeys
	}
	return []*ecdsa.PrivateKey{b.JoinEncryptionKey}
}

// Generate makes a new bundle in memory for trustDomain, valid from now.
// Init uses it and writes the result; tests and `better-compute dev` can use it
// directly.
func Generate(trustDomain string, now time.Time) (*Bundle, error) {
	if err := pki.ValidateTrustDomain(trustDomain); err != nil {
		return nil, err
	}
	b := &Bundle{TrustDomain: trustDomain, CreatedAt: now.UTC().Truncate(time.Second)}
	var err error
	if b.NodeCA, b.NodeCAKey, err = newSelfSigned("better-compute node CA "+trustDomain, true, now); err != nil {
		return nil, fmt.Errorf("make node CA: %w", err)
	}
	if b.ServingCA, b.ServingCAKey, err = newSelfSigned("better-compute serving CA "+trustDomain, true, now); err != nil {
		return nil, fmt.Errorf("make serving CA: %w", err)
	}
	if b.CommandSigningCert, b.CommandSigningKey, err = newSelfSigned("better-compute command signing "+trustDomain, false, now); err != nil {
		return nil, fmt.Errorf("make command-signing key: %w", err)
	}
	if b.JoinSigningCert, b.JoinSigningKey, err = newSelfSigned("better-compute join signing "+trustDomain, false, now); err != nil {
		return nil, fmt.Errorf("make join-signing key: %w", err)
	}
	if b.JoinEncryptionKey, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
		return nil, fmt.Errorf("make join-encryption key: %w", err)
	}
	return b, nil
}

// newSelfSigned makes a P-256 key and a self-signed certificate for it: a CA
// that signs only leaves (path length 0) when ca is set, else a plain signing
// certificate that only publishes a key.
func newSelfSigned(cn string, ca bool, now time.Time) (*x509.Certificate, crypto.Signer, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn, Organization: []string{"better-compute"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(caLifetime),
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature,
	}
	if ca {
		tmpl.IsCA = true
		tmpl.MaxPathLenZero = true
		tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, fmt.Errorf("create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse certificate: %w", err)
	}
	return cert, key, nil
}

// randomSerial returns a random positive 128-bit serial number.
func randomSerial() (*big.Int, error) {
	b := make([]byte, 16)
	for {
		if _, err := rand.Read(b); err != nil {
			return nil, fmt.Errorf("read serial: %w", err)
		}
		n := new(big.Int).SetBytes(b)
		if n.Sign() > 0 {
			return n, nil
		}
	}
}

// Init writes a new bundle for trustDomain into dir, which must not exist
// (or be an empty directory), and returns it. The private keys are encrypted
// with secret (BETTER_COMPUTE_SECRET). Init never overwrites anything: it
// writes a temporary directory beside dir and renames it into place, so a
// failure leaves no half-written bundle.
//
// Errors: errs.InvalidConfig when secret is empty or too weak (CheckSecret),
// errs.InvalidArgument for
// an invalid trust domain, errs.AlreadyExists when dir exists and is not an
// empty directory.
func Init(dir, trustDomain string, secret []byte, now time.Time) (*Bundle, error) {
	return initBundle(dir, trustDomain, secret, now, scryptLogN)
}

func initBundle(dir, trustDomain string, secret []byte, now time.Time, logN int) (*Bundle, error) {
	// Before anything is made: a weak secret writes nothing.
	if err := CheckSecret(secret); err != nil {
		return nil, err
	}
	if err := pki.ValidateTrustDomain(trustDomain); err != nil {
		return nil, err
	}
	if dir == "" {
		return nil, errs.Invalid("dir", "the bundle directory is empty")
	}
	dir = filepath.Clean(dir)
	if err := checkFree(dir); err != nil {
		return nil, err
	}
	b, err := Generate(trustDomain, now)
	if err != nil {
		return nil, err
	}
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return nil, fmt.Errorf("create %s: %w", parent, err)
	}
	tmp, err := os.MkdirTemp(parent, "."+filepath.Base(dir)+".tmp-")
	if err != nil {
		return nil, fmt.Errorf("create temporary directory: %w", err)
	}
	defer os.RemoveAll(tmp) // a no-op once renamed
	if err := os.Chmod(tmp, 0o700); err != nil {
		return nil, fmt.Errorf("chmod temporary directory: %w", err)
	}
	if err := b.write(tmp, secret, logN); err != nil {
		return nil, err
	}
	// An empty directory made beforehand (mkdir, a StateDirectory) is taken
	// over; os.Remove refuses a non-empty one, so nothing is ever lost.
	if fi, err := os.Lstat(dir); err == nil && fi.IsDir() {
		if err := os.Remove(dir); err != nil {
			return nil, errs.New(errs.AlreadyExists, "%s already exists; pki init never overwrites a bundle", dir)
		}
	}
	// os.Rename refuses to replace an existing directory (EEXIST), so a
	// concurrent init cannot be overwritten either.
	if err := os.Rename(tmp, dir); err != nil {
		if errors.Is(err, fs.ErrExist) || errors.Is(err, syscall.ENOTEMPTY) {
			return nil, errs.New(errs.AlreadyExists, "%s already exists; pki init never overwrites a bundle", dir)
		}
		return nil, fmt.Errorf("rename bundle into place: %w", err)
	}
	fsutil.SyncDir(parent)
	return b, nil
}

// checkFree refuses a dir that exists and is not an empty directory.
func checkFree(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("stat %s: %w", dir, err)
	}
	if fi.IsDir() {
		entries, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("read %s: %w", dir, err)
		}
		if len(entries) == 0 {
			return nil
		}
	}
	return errs.New(errs.AlreadyExists, "%s already exists; pki init never overwrites a bundle", dir)
}

func (b *Bundle) write(dir string, secret []byte, logN int) error {
	manifest, err := json.MarshalIndent(Manifest{Version: BundleVersion, TrustDomain: b.TrustDomain, CreatedAt: b.CreatedAt}, "", "  ")
	if err != nil {
		return fmt.Errorf("marshal manifest: %w", err)
	}
	jwk, err := pki.MarshalEncryptionJWK(&b.JoinEncryptionKey.PublicKey)
	if err != nil {
		return err
	}
	files := []struct {
		name string
		data []byte
		mode os.FileMode
	}{
		{FileNodeCACert, pki.CertPEM(b.NodeCA), 0o644},
		{FileServingCACert, pki.CertPEM(b.ServingCA), 0o644},
		{FileCommandSigningCert, pki.CertPEM(b.CommandSigningCert), 0o644},
		{FileJoinSigningCert, pki.CertPEM(b.JoinSigningCert), 0o644},
		{FileJoinEncryptionJWK, append(jwk, '\n'), 0o644},
	}
	for _, k := range []struct {
		name string
		key  crypto.Signer
	}{
		{FileNodeCAKey, b.NodeCAKey},
		{FileServingCAKey, b.ServingCAKey},
		{FileCommandSigningKey, b.CommandSigningKey},
		{FileJoinSigningKey, b.JoinSigningKey},
		{FileJoinEncryptionKey, b.JoinEncryptionKey},
	} {
		data, err := encryptKey(k.key, secret, logN)
		if err != nil {
			return fmt.Errorf("encrypt %s: %w", k.name, err)
		}
		files = append(files, struct {
			name string
			data []byte
			mode os.FileMode
		}{k.name, data, 0o600})
	}
	// The manifest goes last: a directory with bundle.json is complete.
	files = append(files, struct {
		name string
		data []byte
		mode os.FileMode
	}{FileManifest, append(manifest, '\n'), 0o644})
	for _, f := range files {
		if err := fsutil.WriteNew(filepath.Join(dir, f.name), f.data, f.mode); err != nil {
			return err
		}
	}
	fsutil.SyncDir(dir)
	return nil
}

// Load reads the bundle in dir and decrypts its keys with secret. It checks
// the manifest, that every key is P-256 and matches its certificate, that
// the CAs are CAs, and that join-encryption.jwk holds the encryption key.
// Errors are errs.InvalidConfig (no bundle, empty or wrong secret, a
// damaged file).
func Load(dir string, secret []byte) (*Bundle, error) {
	if len(secret) == 0 {
		return nil, errSecretMissing()
	}
	m, err := readManifest(dir)
	if err != nil {
		return nil, err
	}
	b := &Bundle{TrustDomain: m.TrustDomain, CreatedAt: m.CreatedAt}
	pairs := []struct {
		certFile, keyFile string
		ca                bool
		cert              **x509.Certificate
		key               *crypto.Signer
	}{
		{FileNodeCACert, FileNodeCAKey, true, &b.NodeCA, &b.NodeCAKey},
		{FileServingCACert, FileServingCAKey, true, &b.ServingCA, &b.ServingCAKey},
		{FileCommandSigningCert, FileCommandSigningKey, false, &b.CommandSigningCert, &b.CommandSigningKey},
		{FileJoinSigningCert, FileJoinSigningKey, false, &b.JoinSigningCert, &b.JoinSigningKey},
	}
	for _, p := range pairs {
		cert, err := loadCert(filepath.Join(dir, p.certFile))
		if err != nil {
			return nil, err
		}
		if p.ca && !cert.IsCA {
			return nil, errs.New(errs.InvalidConfig, "%s is not a CA certificate", filepath.Join(dir, p.certFile))
		}
		key, err := loadKey(filepath.Join(dir, p.keyFile), secret)
		if err != nil {
			return nil, err
		}
		if !publicKeyEqual(cert.PublicKey, key.Public()) {
			return nil, errs.New(errs.InvalidConfig, "%s does not hold the key of %s", filepath.Join(dir, p.keyFile), p.certFile)
		}
		*p.cert, *p.key = cert, key
	}
	enc, err := loadKey(filepath.Join(dir, FileJoinEncryptionKey), secret)
	if err != nil {
		return nil, err
	}
	b.JoinEncryptionKey = enc.(*ecdsa.PrivateKey) // loadKey checked the type
	jwkRaw, err := os.ReadFile(filepath.Join(dir, FileJoinEncryptionJWK))
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "cannot read %s", filepath.Join(dir, FileJoinEncryptionJWK))
	}
	pub, err := pki.ParseEncryptionJWK(jwkRaw)
	if err != nil || !pub.Equal(&b.JoinEncryptionKey.PublicKey) {
		return nil, errs.New(errs.InvalidConfig, "%s does not hold the join encryption key", filepath.Join(dir, FileJoinEncryptionJWK))
	}
	return b, nil
}

func loadCert(path string) (*x509.Certificate, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "cannot read %s", path)
	}
	block, _ := pem.Decode(raw)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, errs.New(errs.InvalidConfig, "%s is not a PEM certificate", path)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "%s is not a valid certificate", path)
	}
	if !pki.IsP256(cert.PublicKey) {
		return nil, errs.New(errs.InvalidConfig, "%s does not hold an ECDSA P-256 key", path)
	}
	return cert, nil
}

func loadKey(path string, secret []byte) (crypto.Signer, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "cannot read %s", path)
	}
	key, err := DecryptKey(raw, secret)
	if err != nil {
		// While the secret rotates (RekeyDir), the same key is also
		// beside it under the other secret.
		for _, alt := range []string{path + SuffixNext, path + SuffixPrev} {
			if r, rerr := os.ReadFile(alt); rerr == nil {
				if k, kerr := DecryptKey(r, secret); kerr == nil {
					key, err = k, nil
					break
				}
			}
		}
	}
	if err != nil {
		if e, ok := errs.As(err); ok {
			return nil, errs.New(e.Code, "%s: %s", path, e.Message)
		}
		return nil, fmt.Errorf("decrypt %s: %w", path, err)
	}
	if ek, ok := key.(*ecdsa.PrivateKey); !ok || ek.Curve != elliptic.P256() {
		return nil, errs.New(errs.InvalidConfig, "%s does not hold an ECDSA P-256 key", path)
	}
	return key, nil
}

func publicKeyEqual(a, b crypto.PublicKey) bool {
	ka, ok := a.(*ecdsa.PublicKey)
	return ok && ka.Equal(b)
}

// Pins returns the pins a bcd config carries: the serving CA's key, the
// join-signing key and the join-encryption key.
func (b *Bundle) Pins() (pki.Pins, error) {
	return pinsOf(b.ServingCA.PublicKey, b.JoinSigningCert.PublicKey, &b.JoinEncryptionKey.PublicKey)
}

func pinsOf(servingCA, joinSigning, joinEncryption crypto.PublicKey) (pki.Pins, error) {
	var p pki.Pins
	var err error
	if p.ServingCA, err = pki.Pin(servingCA); err != nil {
		return pki.Pins{}, fmt.Errorf("pin serving CA: %w", err)
	}
	if p.JoinSigning, err = pki.Pin(joinSigning); err != nil {
		return pki.Pins{}, fmt.Errorf("pin join-signing key: %w", err)
	}
	if p.JoinEncryption, err = pki.Pin(joinEncryption); err != nil {
		return pki.Pins{}, fmt.Errorf("pin join-encryption key: %w", err)
	}
	return p, nil
}

// EncryptionJWK returns the public join-encryption key as a JWK (kty, crv, x,
// y), the well-known document's join.encryptionJwk.
func (b *Bundle) EncryptionJWK() jose.JSONWebKey {
	return jose.JSONWebKey{Key: &b.JoinEncryptionKey.PublicKey}
}

// SigningCertificateDER returns the join-signing certificate's DER, the
// well-known document's join.signingCertificate (base64 of it).
func (b *Bundle) SigningCertificateDER() []byte {
	return b.JoinSigningCert.Raw
}

// WellKnownJoin returns the join section of the well-known document.
func (b *Bundle) WellKnownJoin() (pki.WellKnownJoin, error) {
	jwk, err := pki.MarshalEncryptionJWK(&b.JoinEncryptionKey.PublicKey)
	if err != nil {
		return pki.WellKnownJoin{}, err
	}
	pins, err := b.Pins()
	if err != nil {
		return pki.WellKnownJoin{}, err
	}
	return pki.WellKnownJoin{
		EncryptionJWK:      jwk,
		EncryptionKeyPin:   pins.JoinEncryption,
		SigningCertificate: base64.StdEncoding.EncodeToString(b.JoinSigningCert.Raw),
		SigningKeyPin:      pins.JoinSigning,
		KeyStatements:      b.KeyStatements,
	}, nil
}
