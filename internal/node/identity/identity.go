// Package identity owns bcd's data directory (/var/lib/bcd by default): the
// node key record (node.key, 0600), the certificate chain (node.crt, leaf
// first), the command-signing trust bundle (bundle.pem) and identity.json,
// what the node is (R4.1, R4.6). It writes them as one step, loads and
// cross-checks them, and replaces or moves them aside for `bcd join --reset
// --yes` (R11.4). It also makes the CSR (NewCSR).
//
// The key itself sits behind KeyStore so the TPM (R9.1) can plug in:
// SoftwareKeys keeps a PKCS#8 key in node.key; a TPM store keeps a
// "TSS2 PRIVATE KEY" record there.
//
// An identity whose certificate expired still loads (bcd keeps such an
// identity, R11.4); callers decide what an expired identity means.
//
// SECURITY: node.key is the node's credential. It is written 0600 and
// checked after writing, and Load refuses one that group or others can read.
package identity

import (
	"bytes"
	"crypto"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Files in the data directory.
const (
	KeyFile      = "node.key"
	CertFile     = "node.crt"
	BundleFile   = "bundle.pem"
	IdentityFile = "identity.json"
)

// Attestor names recorded in identity.json. The wire's empty attestor is
// the join token.
const AttestorJoinToken = wire.AttestorJoinToken

// AttestorDiscovery joins a ramdisk its site booted (R10.4).
const AttestorDiscovery = wire.AttestorDiscovery

// AttestorX509Pop re-joins a node whose certificate expired while the
// machine was offline (R10.5).
const AttestorX509Pop = wire.AttestorX509Pop

// Modes of the files and the directory.
const (
	dirMode    fs.FileMode = 0o700
	keyMode    fs.FileMode = 0o600
	publicMode fs.FileMode = 0o644

	stagingPrefix  = ".staging-"
	previousPrefix = ".previous-"
	resetPrefix    = "reset-"
	resetLayout    = "20060102T150405Z"

	maxFileSize = 64 << 10
)

// fileNames lists the identity's files in the order Save renames them into
// place: identity.json last, since Load starts from it.
func fileNames() [4]string { return [4]string{KeyFile, CertFile, BundleFile, IdentityFile} }

// ErrNotJoined is returned (wrapped) by Load and MoveAside when the data
// directory holds no identity.
var ErrNotJoined = errs.New(errs.InvalidState, "this machine has not joined: run bcd join")

// fixByRejoining is how an operator repairs a broken identity (R11.4).
const fixByRejoining = "join again as root: bcd join --reset --yes, then bcd join"

// x509popWindow is how long after its expiry the control plane lets a
// certificate re-join its node by x509pop (R10.5); the control plane
// decides, bcd only names it.
const x509popWindow = 7 * 24 * time.Hour

// ExpiredFix is the way back for a certificate that expired at notAfter
// (R11.4): join again with a new token, or, within the x509pop window,
// re-join as the same node with the expired certificate's key. The second
// is the only way back for a site agent: site tokens are not minted
// through the API, so --reset then a join is a dead end for one.
func ExpiredFix(notAfter time.Time) string {
	return fmt.Sprintf("%s; or, until %s, re-join as the same node without a token: bcd join --attestor x509pop (when the control plane runs the x509pop attestor; the way back for a site agent)",
		fixByRejoining, notAfter.Add(x509popWindow).UTC().Format(time.RFC3339))
}

// Identity is what the node is. The JSON fields are identity.json; the rest
// is filled by Load (and NewIdentity fills Chain).
type Identity struct {
	NodeID      string    `json:"node_id"`
	SiteID      string    `json:"site_id"`
	TrustDomain string    `json:"trust_domain"`
	Role        string    `json:"role"`
	SPIFFEID    string    `json:"spiffe_id"`
	Serial      string    `json:"serial"` // lower-case hex (pki.SerialHex)
	NotAfter    time.Time `json:"not_after"`
	JoinedAt    time.Time `json:"joined_at"`
	// Attestor admitted the node: join-token, tpm, x509pop, …
	Attestor string `json:"attestor"`
	// IdentityGeneration is the node's identity generation from the
	// signed join or renewal answer (R4.4, R12.3): bcd refuses commands of
	// another generation. 0 means unknown: an identity saved before bcd
	// kept it, or from a server that does not send it. bcd then accepts
	// only commands issued after JoinedAt (every command of an older
	// generation was issued before this identity existed) until a renewal
	// tells it the generation (internal/node/run, Verify).
	IdentityGeneration int64 `json:"identity_generation,omitempty"`

	// Chain is node.crt parsed, leaf first.
	Chain []*x509.Certificate `json:"-"`
	// Bundle is bundle.pem parsed: the command-signing trust bundle.
	Bundle []*x509.Certificate `json:"-"`
	// Signer is the node key, opened through the Store's KeyStore.
	Signer crypto.Signer `json:"-"`
	// KeyKind is KindSoftware or KindTPM.
	KeyKind string `json:"-"`
}

// Leaf returns the node certificate, or nil.
func (id *Identity) Leaf() *x509.Certificate {
	if len(id.Chain) == 0 {
		return nil
	}
	return id.Chain[0]
}

// Expired reports whether the certificate expired at now.
func (id *Identity) Expired(now time.Time) bool { return !now.Before(id.NotAfter) }

// NewIdentity builds the identity a certificate chain (PEM, leaf first)
// describes: node, site, trust domain and role from the leaf's SPIFFE SAN
// and OU (pki.NodeIdentityOf), serial and NotAfter from the leaf. attestor
// "" means the join token.
func NewIdentity(chainPEM []byte, attestor string, joinedAt time.Time) (*Identity, error) {
	chain, err := parseCerts(chainPEM, CertFile, false)
	if err != nil {
		return nil, err
	}
	leaf := chain[0]
	ni, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidArgument, "the node certificate is not a node certificate: %v", err)
	}
	if attestor == "" {
		attestor = AttestorJoinToken
	}
	return &Identity{
		NodeID:      ni.NodeID,
		SiteID:      ni.SiteID,
		TrustDomain: ni.TrustDomain,
		Role:        ni.Role,
		SPIFFEID:    ni.SPIFFEID(),
		Serial:      pki.SerialHex(leaf),
		NotAfter:    leaf.NotAfter.UTC(),
		JoinedAt:    joinedAt.UTC(),
		Attestor:    attestor,
		Chain:       chain,
	}, nil
}

// Store is the data directory. A node.key holding a software key always
// opens with SoftwareKeys; one holding a TPM record opens with TPMKeys (nil:
// the TPM is not in use, and such a record is refused with a message that
// says so). Choosing by the record, not by today's config, keeps a node that
// joined with a software key loadable after a TPM appears.
type Store struct {
	Dir     string
	TPMKeys KeyStore

	// rename replaces os.Rename in tests, to fail a step of Save.
	rename func(oldpath, newpath string) error
}

// keysFor returns the KeyStore that opens records of kind.
func (s *Store) keysFor(kind string) KeyStore {
	if kind == KindTPM && s.TPMKeys != nil {
		return s.TPMKeys
	}
	return SoftwareKeys{}
}

func (s *Store) doRename(oldpath, newpath string) error {
	if s.rename != nil {
		return s.rename(oldpath, newpath)
	}
	return os.Rename(oldpath, newpath)
}

func (s *Store) path(name string) string { return filepath.Join(s.Dir, name) }

// Present reports which identity files exist in the directory.
func (s *Store) Present() ([]string, error) {
	var present []string
	for _, f := range fileNames() {
		_, err := os.Lstat(s.path(f))
		switch {
		case err == nil:
			present = append(present, f)
		case !errors.Is(err, fs.ErrNotExist):
			return nil, fmt.Errorf("stat %s: %w", s.path(f), err)
		}
	}
	return present, nil
}

// Load reads and cross-checks the identity: identity.json agrees with the
// leaf of node.crt, node.key opens to the leaf's key, and
// bundle.pem holds certificates. It returns an error matching ErrNotJoined
// when no identity file exists, and errs.InvalidState naming the fix when
// the identity is incomplete or inconsistent. An expired certificate loads.
func (s *Store) Load() (*Identity, error) {
	present, err := s.Present()
	if err != nil {
		return nil, err
	}
	if len(present) == 0 {
		return nil, fmt.Errorf("%s: %w", s.Dir, ErrNotJoined)
	}
	if len(present) != len(fileNames()) {
		var missing []string
		for _, f := range fileNames() {
			if !contains(present, f) {
				missing = append(missing, f)
			}
		}
		return nil, errs.New(errs.InvalidState, "the identity in %s is incomplete (no %s); %s", s.Dir, strings.Join(missing, ", "), fixByRejoining)
	}

	record, err := s.readKey()
	if err != nil {
		return nil, err
	}
	meta, err := s.readFile(IdentityFile)
	if err != nil {
		return nil, err
	}
	var id Identity
	if err := json.Unmarshal(meta, &id); err != nil {
		return nil, s.inconsistent("%s is not valid JSON", IdentityFile)
	}
	chainPEM, err := s.readFile(CertFile)
	if err != nil {
		return nil, err
	}
	bundlePEM, err := s.readFile(BundleFile)
	if err != nil {
		return nil, err
	}
	if err := s.check(&id, record, chainPEM, bundlePEM); err != nil {
		return nil, err
	}
	return &id, nil
}

// check fills id's Chain, Bundle, Signer and KeyKind and checks that the
// pieces belong together.
func (s *Store) check(id *Identity, record, chainPEM, bundlePEM []byte) error {
	fromChain, err := NewIdentity(chainPEM, id.Attestor, id.JoinedAt)
	if err != nil {
		return s.inconsistent("%v", errs.MessageOf(err))
	}
	if id.NodeID != fromChain.NodeID || id.SiteID != fromChain.SiteID ||
		id.TrustDomain != fromChain.TrustDomain || id.Role != fromChain.Role ||
		id.SPIFFEID != fromChain.SPIFFEID || id.Serial != fromChain.Serial ||
		!id.NotAfter.Equal(fromChain.NotAfter) {
		return s.inconsistent("%s does not describe the certificate in %s", IdentityFile, CertFile)
	}
	if id.Attestor == "" || id.JoinedAt.IsZero() {
		return s.inconsistent("%s lacks attestor or joined_at", IdentityFile)
	}
	if id.IdentityGeneration < 0 {
		return s.inconsistent("%s has a negative identity_generation", IdentityFile)
	}
	bundle, err := parseCerts(bundlePEM, BundleFile, true)
	if err != nil {
		return s.inconsistent("%v", errs.MessageOf(err))
	}
	kind := RecordKind(record)
	if kind == "" {
		return s.inconsistent("%s holds neither a %q nor a %q PEM block", KeyFile, PEMTypeSoftware, PEMTypeTPM)
	}
	signer, err := s.keysFor(kind).LoadKey(record)
	if err != nil {
		return err
	}
	if !publicKeyEqual(signer.Public(), fromChain.Chain[0].PublicKey) {
		return s.inconsistent("%s is not the key of the certificate in %s", KeyFile, CertFile)
	}
	id.Chain, id.Bundle, id.Signer, id.KeyKind = fromChain.Chain, bundle, signer, kind
	return nil
}

func (s *Store) inconsistent(format string, args ...any) error {
	return errs.New(errs.InvalidState, "the identity in %s is damaged: %s; %s", s.Dir, fmt.Sprintf(format, args...), fixByRejoining)
}

// readKey reads node.key after checking that it is a regular file that only
// its owner can read.
func (s *Store) readKey() ([]byte, error) {
	p := s.path(KeyFile)
	st, err := os.Lstat(p)
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", p, err)
	}
	if !st.Mode().IsRegular() {
		return nil, errs.New(errs.InvalidState, "%s is not a regular file (%s); %s", p, st.Mode().Type(), fixByRejoining)
	}
	// SECURITY: a key others could read may have been copied; say so
	// rather than quietly tightening the mode.
	if perm := st.Mode().Perm(); perm&0o077 != 0 {
		return nil, errs.New(errs.InvalidState,
			"%s is readable by group or others (mode %04o, want 0600): run chmod 600 %s; if anyone else may have read it, %s",
			p, perm, p, fixByRejoining)
	}
	return s.readFile(KeyFile)
}

func (s *Store) readFile(name string) ([]byte, error) {
	p := s.path(name)
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", p, err)
	}
	if len(data) > maxFileSize {
		return nil, s.inconsistent("%s is larger than %d bytes", name, maxFileSize)
	}
	return data, nil
}

// Save writes a new identity as one step: every file is written into a new
// staging directory inside Dir and synced, the files of an identity already
// in place are kept as hard links in a backup directory, then the new files
// are renamed into place (identity.json last). On any failure the files
// already renamed are put back (or removed when there was no old one), so
// nothing of the new identity remains and an old one is untouched.
//
// id must describe chainPEM's leaf (NewIdentity makes one that does), and
// keyRecord must open to the leaf's key. Dir is created 0700
// when missing.
//
// A crash (not an error) between two renames can leave a mix; Load then
// reports the identity damaged, and the old files are still in the
// .previous-* directory.
func (s *Store) Save(id *Identity, keyRecord, chainPEM, bundlePEM []byte) (err error) {
	if id == nil {
		return errs.New(errs.InvalidArgument, "no identity to save")
	}
	check := *id
	if err := s.check(&check, keyRecord, chainPEM, bundlePEM); err != nil {
		return err
	}
	meta, err := json.MarshalIndent(&check, "", "  ")
	if err != nil {
		return fmt.Errorf("marshal %s: %w", IdentityFile, err)
	}
	meta = append(meta, '\n')

	if err := os.MkdirAll(s.Dir, dirMode); err != nil {
		return fmt.Errorf("create data directory: %w", err)
	}
	s.removeStale()

	staging, err := os.MkdirTemp(s.Dir, stagingPrefix)
	if err != nil {
		return fmt.Errorf("create staging directory: %w", err)
	}
	defer os.RemoveAll(staging)
	content := map[string][]byte{KeyFile: keyRecord, CertFile: chainPEM, BundleFile: bundlePEM, IdentityFile: meta}
	for _, name := range fileNames() {
		mode := publicMode
		if name == KeyFile {
			mode = keyMode
		}
		if err := fsutil.WriteNew(filepath.Join(staging, name), content[name], mode); err != nil {
			return err
		}
	}
	// SECURITY: check what the filesystem actually recorded for the key.
	if st, err := os.Stat(filepath.Join(staging, KeyFile)); err != nil || st.Mode().Perm() != keyMode {
		return fmt.Errorf("write %s: mode is not 0600 after writing (%v)", KeyFile, err)
	}
	fsutil.SyncDir(staging)

	// Keep the old identity reachable until the new one is complete.
	backup, err := os.MkdirTemp(s.Dir, previousPrefix)
	if err != nil {
		return fmt.Errorf("create backup directory: %w", err)
	}
	hadOld := map[string]bool{}
	for _, name := range fileNames() {
		err := os.Link(s.path(name), filepath.Join(backup, name))
		switch {
		case err == nil:
			hadOld[name] = true
		case errors.Is(err, fs.ErrNotExist):
		default:
			_ = os.RemoveAll(backup)
			return fmt.Errorf("keep the old %s: %w", name, err)
		}
	}
	fsutil.SyncDir(backup)

	var placed []string
	defer func() {
		if err == nil {
			_ = os.RemoveAll(backup)
			return
		}
		// Roll back in reverse order; a failure here leaves the old
		// files in the backup directory, named in the error.
		for i := len(placed) - 1; i >= 0; i-- {
			name := placed[i]
			if hadOld[name] {
				if rerr := os.Rename(filepath.Join(backup, name), s.path(name)); rerr != nil {
					err = fmt.Errorf("%w; restoring the old %s failed (%v): it is in %s", err, name, rerr, backup)
					return
				}
			} else if rerr := os.Remove(s.path(name)); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
				err = fmt.Errorf("%w; removing the new %s failed: %v", err, name, rerr)
			}
		}
		fsutil.SyncDir(s.Dir)
		_ = os.RemoveAll(backup)
	}()
	for _, name := range fileNames() {
		if err := s.doRename(filepath.Join(staging, name), s.path(name)); err != nil {
			return fmt.Errorf("move %s into place: %w", name, err)
		}
		placed = append(placed, name)
	}
	fsutil.SyncDir(s.Dir)
	return nil
}

// removeStale removes staging directories a crashed Save left behind. Backup
// directories are kept: after a crash they may hold the only complete
// identity.
func (s *Store) removeStale() {
	entries, err := os.ReadDir(s.Dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), stagingPrefix) {
			_ = os.RemoveAll(s.path(e.Name()))
		}
	}
}

// MoveAside moves the identity files into a new directory
// <Dir>/reset-<UTC timestamp>/ (0700) and returns its path, for
// `bcd join --reset --yes` (R11.4). The files are kept, not deleted, so an
// operator can still look at what the node was. It returns an error matching
// ErrNotJoined when there is nothing to move; a partial identity is moved
// as it is. On failure the files already moved are put back.
func (s *Store) MoveAside(now time.Time) (string, error) {
	present, err := s.Present()
	if err != nil {
		return "", err
	}
	if len(present) == 0 {
		return "", fmt.Errorf("%s: %w", s.Dir, ErrNotJoined)
	}
	dst, err := s.newResetDir(now)
	if err != nil {
		return "", err
	}
	var moved []string
	for _, name := range present {
		if err := s.doRename(s.path(name), filepath.Join(dst, name)); err != nil {
			for _, m := range moved {
				_ = os.Rename(filepath.Join(dst, m), s.path(m))
			}
			_ = os.Remove(dst)
			return "", fmt.Errorf("move %s aside: %w", name, err)
		}
		moved = append(moved, name)
	}
	fsutil.SyncDir(dst)
	fsutil.SyncDir(s.Dir)
	return dst, nil
}

// newResetDir creates a new, empty <Dir>/reset-<UTC timestamp>[-n]/ (0700).
func (s *Store) newResetDir(now time.Time) (string, error) {
	base := resetPrefix + now.UTC().Format(resetLayout)
	for i := 1; ; i++ {
		dst := s.path(base)
		if i > 1 {
			dst += "-" + strconv.Itoa(i)
		}
		err := os.Mkdir(dst, dirMode)
		if err == nil {
			return dst, nil
		}
		if !errors.Is(err, fs.ErrExist) || i >= 100 {
			return "", fmt.Errorf("create %s: %w", dst, err)
		}
	}
}

// Replace installs a new identity in place of the one in Dir and keeps the
// old one in a new directory <Dir>/reset-<UTC timestamp>/, as MoveAside
// does, for `bcd join --reset --yes` (R11.4) and the x509pop re-join
// (R10.5) once the new identity was answered and checked. It returns that
// directory, or "" when there was no old identity (Replace then is Save).
//
// Unlike MoveAside followed by Save, the old identity never leaves its
// place before the new one is complete: the old files are first hard-linked
// into the reset directory, then Save replaces them one rename at a time
// and rolls back on failure. So a failure at any step leaves the old
// identity in place and loadable (the reset directory is removed), and
// `bcd run` can go on using it until the new one is in place. A crash
// leaves at worst an extra reset directory, or Save's .previous-* backup.
func (s *Store) Replace(now time.Time, id *Identity, keyRecord, chainPEM, bundlePEM []byte) (string, error) {
	present, err := s.Present()
	if err != nil {
		return "", err
	}
	if len(present) == 0 {
		return "", s.Save(id, keyRecord, chainPEM, bundlePEM)
	}
	dst, err := s.newResetDir(now)
	if err != nil {
		return "", err
	}
	for _, name := range present {
		if err := os.Link(s.path(name), filepath.Join(dst, name)); err != nil {
			_ = os.RemoveAll(dst)
			return "", fmt.Errorf("keep the old %s in %s: %w", name, dst, err)
		}
	}
	fsutil.SyncDir(dst)
	if err := s.Save(id, keyRecord, chainPEM, bundlePEM); err != nil {
		// Save put the old files back; the links are not needed.
		_ = os.RemoveAll(dst)
		return "", err
	}
	return dst, nil
}

// Restore moves the identity files MoveAside put in dir back into the data
// directory and removes dir, undoing MoveAside; it refuses when an identity
// file is in place. On failure the files already moved back are returned to
// dir, so the identity is whole in one of the two places.
func (s *Store) Restore(dir string) error {
	present, err := s.Present()
	if err != nil {
		return err
	}
	if len(present) > 0 {
		return errs.New(errs.InvalidState, "cannot restore the identity from %s: %s already holds %s", dir, s.Dir, strings.Join(present, ", "))
	}
	var moved []string
	for _, name := range fileNames() {
		err := s.doRename(filepath.Join(dir, name), s.path(name))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			for _, m := range moved {
				_ = os.Rename(s.path(m), filepath.Join(dir, m))
			}
			return fmt.Errorf("move %s back from %s: %w", name, dir, err)
		}
		moved = append(moved, name)
	}
	fsutil.SyncDir(s.Dir)
	_ = os.Remove(dir)
	return nil
}

// parseCerts parses a PEM file of one or more CERTIFICATE blocks and
// nothing else. The certificates after the first (a node chain's CAs), or
// all of them when shareFirst (a bundle), are shared with other identities
// that hold the same (certcache.go); a node's own certificate is its own.
func parseCerts(data []byte, name string, shareFirst bool) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	rest := data
	for {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, errs.New(errs.InvalidArgument, "%s holds a %q PEM block, want only certificates", name, block.Type)
		}
		parse := x509.ParseCertificate
		if shareFirst || len(certs) > 0 {
			parse = parseShared
		}
		c, err := parse(block.Bytes)
		if err != nil {
			return nil, errs.New(errs.InvalidArgument, "%s holds a certificate that does not parse", name)
		}
		certs = append(certs, c)
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, errs.New(errs.InvalidArgument, "%s holds data that is not PEM", name)
	}
	if len(certs) == 0 {
		return nil, errs.New(errs.InvalidArgument, "%s holds no certificate", name)
	}
	return certs, nil
}

func publicKeyEqual(a, b crypto.PublicKey) bool {
	k, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && k.Equal(b)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
