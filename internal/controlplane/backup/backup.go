package backup

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Config says what Create backs up and where to.
type Config struct {
	// Store is the server's database; only SQLite is copied.
	Store store.Config
	// PKIDir is the bundle directory (pki.dir); "" backs up the database
	// alone.
	PKIDir string
	// Out is the archive to write. It must not exist.
	Out string
	// Secret is BETTER_COMPUTE_SECRET: the archive's MAC key is derived
	// from it (mac.go). It is not written anywhere.
	Secret []byte
	// Clock stamps the manifest; nil is the wall clock.
	Clock clock.Clock
	// Progress receives one line per step; nil drops them.
	Progress func(format string, args ...any)
}

func (c *Config) progress(format string, args ...any) {
	if c.Progress != nil {
		c.Progress(format, args...)
	}
}

// pkiSuffixes are the PKI files a backup holds: the manifest (bundle.json),
// certificates, encrypted keys (with their copies under the other secret
// while BETTER_COMPUTE_SECRET rotates) and the public JWK. Anything else in
// the directory is left out and named in the progress lines.
var pkiSuffixes = []string{".json", ".crt", ".key", ".key" + ca.SuffixNext, ".key" + ca.SuffixPrev, ".jwk", ".pem"}

// isKeyFile reports whether name is an encrypted key file.
func isKeyFile(name string) bool {
	return strings.HasSuffix(name, ".key") || strings.HasSuffix(name, ".key"+ca.SuffixNext) || strings.HasSuffix(name, ".key"+ca.SuffixPrev)
}

// member is one file going into the archive: in memory (PKI files, small)
// or on disk (the database copy).
type member struct {
	File
	data []byte
	path string
}

// Create writes a backup archive of cfg's database and PKI directory to
// cfg.Out, atomically (a temporary file beside it, linked into place, 0600)
// and never over an existing file. The database copy is consistent while
// the server keeps writing (store.SnapshotSQLite).
func Create(ctx context.Context, cfg Config) (Manifest, error) {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Out == "" {
		return Manifest{}, errs.Invalid("--out", "required")
	}
	if _, err := os.Lstat(cfg.Out); !errors.Is(err, fs.ErrNotExist) {
		return Manifest{}, errs.New(errs.AlreadyExists, "--out %s exists: a backup never overwrites a file", cfg.Out)
	}
	if len(cfg.Secret) == 0 {
		// Checked first, so nothing is copied for an archive never written.
		return Manifest{}, errNoSecret()
	}
	tmp, err := os.MkdirTemp(filepath.Dir(cfg.Out), ".bc-backup-*")
	if err != nil {
		return Manifest{}, fmt.Errorf("create a temporary directory beside %s: %w", cfg.Out, err)
	}
	defer os.RemoveAll(tmp)

	m := Manifest{Format: Format, Store: string(store.SQLite)}
	pkiFiles, td, err := readPKI(cfg.PKIDir, cfg.progress)
	if err != nil {
		return Manifest{}, err
	}
	m.TrustDomain = td
	cfg.progress("copying the database %s", cfg.Store.Path)
	// The manifest's time is taken before the copy: whatever happened
	// after it may be missing from the copy, and a restore tells nodes so.
	m.CreatedAt = cfg.Clock.Now().UTC().Truncate(time.Millisecond)
	dbCopy := filepath.Join(tmp, "bc.db")
	if m.SchemaVersion, err = store.SnapshotSQLite(ctx, cfg.Store, dbCopy); err != nil {
		return Manifest{}, err
	}
	dbFile, err := hashFile(dbCopy)
	if err != nil {
		return Manifest{}, err
	}
	dbFile.Name = memberDB
	cfg.progress("copied the database: %d bytes, schema version %d", dbFile.Size, m.SchemaVersion)
	members := append([]member{{File: dbFile, path: dbCopy}}, pkiFiles...)
	for _, mb := range members {
		m.Files = append(m.Files, mb.File)
	}
	archive := filepath.Join(tmp, "backup.tar.gz")
	if err := writeArchive(archive, m, members, cfg.Secret); err != nil {
		return Manifest{}, err
	}
	if err := publish(archive, cfg.Out); err != nil {
		return Manifest{}, err
	}
	cfg.progress("wrote %s", cfg.Out)
	return m, nil
}

// readPKI reads the PKI files of dir (recursively, regular files only) and
// the bundle's trust domain.
//
// SECURITY: every .key file must be a key encrypted with
// BETTER_COMPUTE_SECRET; a key in the clear is refused rather than copied
// into an archive that is kept apart from the secret. Files named like a
// secret are never taken.
func readPKI(dir string, progress func(string, ...any)) ([]member, string, error) {
	if dir == "" {
		progress("no pki.dir configured: backing up the database alone")
		return nil, "", nil
	}
	var out []member
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || d.IsDir() {
			return err
		}
		name := pkiPrefix + filepath.ToSlash(rel)
		if !d.Type().IsRegular() || !hasSuffix(d.Name(), pkiSuffixes) || strings.Contains(strings.ToLower(d.Name()), "secret") {
			progress("left out %s: not a PKI file", name)
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if isKeyFile(d.Name()) && !encryptedKey(b) {
			return errs.New(errs.InvalidState, "%s is not a key encrypted with BETTER_COMPUTE_SECRET: refusing to put a key in the clear into a backup", p)
		}
		sum := sha256.Sum256(b)
		out = append(out, member{File: File{Name: name, Size: int64(len(b)), SHA256: hex.EncodeToString(sum[:])}, data: b})
		return nil
	})
	if err != nil {
		var e *errs.E
		if errors.As(err, &e) {
			return nil, "", err
		}
		return nil, "", errs.Wrap(err, errs.InvalidConfig, "read pki.dir %s: %v", dir, err)
	}
	var bm ca.Manifest
	raw, err := os.ReadFile(filepath.Join(dir, ca.FileManifest))
	if err == nil {
		err = json.Unmarshal(raw, &bm)
	}
	if err != nil {
		return nil, "", errs.Wrap(err, errs.InvalidConfig, "pki.dir %s: read %s: %v", dir, ca.FileManifest, err)
	}
	progress("read %d PKI files of trust domain %s from %s (the secret is not among them: keep it apart)", len(out), bm.TrustDomain, dir)
	return out, bm.TrustDomain, nil
}

func hasSuffix(name string, suffixes []string) bool {
	for _, s := range suffixes {
		if strings.HasSuffix(name, s) {
			return true
		}
	}
	return false
}

// encryptedKey reports whether b is one PEM block of an encrypted key and
// nothing else.
func encryptedKey(b []byte) bool {
	blk, rest := pem.Decode(b)
	return blk != nil && blk.Type == ca.EncryptedKeyPEMType && len(bytes.TrimSpace(rest)) == 0
}

func hashFile(p string) (File, error) {
	f, err := os.Open(p)
	if err != nil {
		return File{}, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return File{}, fmt.Errorf("read %s: %w", p, err)
	}
	return File{Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}

// writeArchive writes the manifest, its MAC under secret and the members
// to a new file at p (0600) and syncs it.
func writeArchive(p string, m Manifest, members []member, secret []byte) (err error) {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create the archive: %w", err)
	}
	defer func() { err = errors.Join(err, f.Close()) }()
	zw := gzip.NewWriter(f)
	tw := tar.NewWriter(zw)
	mj, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	mac, err := sealManifest(mj, secret)
	if err != nil {
		return err
	}
	if err := writeMember(tw, memberManifest, m.CreatedAt, int64(len(mj)), bytes.NewReader(mj)); err != nil {
		return err
	}
	if err := writeMember(tw, memberMAC, m.CreatedAt, int64(len(mac)), bytes.NewReader(mac)); err != nil {
		return err
	}
	for _, mb := range members {
		var r io.Reader = bytes.NewReader(mb.data)
		if mb.path != "" {
			src, err := os.Open(mb.path)
			if err != nil {
				return err
			}
			defer src.Close()
			r = src
		}
		if err := writeMember(tw, mb.Name, m.CreatedAt, mb.Size, r); err != nil {
			return err
		}
	}
	if err := errors.Join(tw.Close(), zw.Close()); err != nil {
		return fmt.Errorf("write the archive: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync the archive: %w", err)
	}
	return nil
}

func writeMember(tw *tar.Writer, name string, mod time.Time, size int64, r io.Reader) error {
	if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: size, ModTime: mod, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if n, err := io.Copy(tw, r); err != nil || n != size {
		return fmt.Errorf("write %s: %d of %d bytes: %v", name, n, size, err)
	}
	return nil
}

// publish puts the finished archive at out without ever replacing a file
// there: a hard link fails when out exists, and the temporary name goes
// with the temporary directory. Where links are not supported it renames,
// after checking again.
func publish(tmp, out string) error {
	err := os.Link(tmp, out)
	if errors.Is(err, fs.ErrExist) {
		return errs.New(errs.AlreadyExists, "--out %s exists: a backup never overwrites a file", out)
	}
	if err != nil {
		if _, serr := os.Lstat(out); !errors.Is(serr, fs.ErrNotExist) {
			return errs.New(errs.AlreadyExists, "--out %s exists: a backup never overwrites a file", out)
		}
		if err := os.Rename(tmp, out); err != nil {
			return fmt.Errorf("write %s: %w", out, err)
		}
	}
	return syncDir(filepath.Dir(out))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
