package backup

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// RestoreConfig says which archive to restore where.
type RestoreConfig struct {
	// In is the archive Create wrote.
	In string
	// DataDir is the directory to create: it must not exist or be empty.
	// It receives bc.db (the database) and pki/ (the bundle).
	DataDir string
	// KeepTokens leaves the join tokens live in the backup live. Only for
	// a backup known to be the latest state (nothing joined since).
	KeepTokens bool
	Auth
	// Log is the database's log; nil discards it.
	Log *slog.Logger
	// Progress receives one line per step; nil drops them.
	Progress func(format string, args ...any)
}

func (c *RestoreConfig) progress(format string, args ...any) {
	if c.Progress != nil {
		c.Progress(format, args...)
	}
}

// Auth is what an archive is authenticated with.
type Auth struct {
	// Secret is BETTER_COMPUTE_SECRET as it was when the backup was taken:
	// the archive's MAC key is derived from it.
	Secret []byte
	// Unauthenticated accepts an archive without a MAC (FormatUnauthenticated,
	// written by an older release). SECURITY: nothing then shows the
	// archive is the one backup wrote; the caller warns loudly. An archive
	// that has a MAC must verify all the same.
	Unauthenticated bool
}

// Restored is what Restore did.
type Restored struct {
	Manifest Manifest
	// Authenticated is false for an archive without a MAC, taken only with
	// Auth.Unauthenticated.
	Authenticated bool
	// DBPath and PKIDir are where the database and bundle now are:
	// store.path and pki.dir of the restored server's config.
	DBPath, PKIDir string
	// SchemaVersion is the database's schema after restoring (the
	// binary's: an older backup is migrated).
	SchemaVersion int64
	// RevokedTokens are the join tokens that were live in the backup and
	// are revoked now (none with KeepTokens).
	RevokedTokens []store.JoinToken
	// Nodes is how many nodes the backup knows.
	Nodes int64
}

// The names in a restored data directory.
const (
	DBFile = "bc.db"
	PKIDir = "pki"
)

// restoreActor is the audit actor of what a restore writes.
const restoreActor = "system"

// Verified is what Verify found.
type Verified struct {
	Manifest Manifest
	// Authenticated is false for an archive without a MAC, taken only with
	// Auth.Unauthenticated.
	Authenticated bool
}

// Verify reads the whole archive at in and checks its MAC under auth, its
// members against its manifest, and that the database copy is at the
// manifest's schema version. It writes nothing but a temporary copy of
// the database, removed before it returns.
func Verify(ctx context.Context, in string, auth Auth) (Verified, error) {
	tmp, err := os.MkdirTemp("", "bc-verify-*")
	if err != nil {
		return Verified{}, err
	}
	defer os.RemoveAll(tmp)
	put := func(name string) (io.WriteCloser, error) {
		if name == memberDB {
			return os.OpenFile(filepath.Join(tmp, DBFile), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		}
		return nopCloser{io.Discard}, nil
	}
	// Only the database copy is written (to tmp).
	need := func(m Manifest) int64 {
		f, _ := m.file(memberDB)
		return f.Size
	}
	x := extraction{in: in, auth: auth, dir: tmp, need: need, put: put}
	m, authed, err := x.run()
	if err != nil {
		return Verified{Manifest: m}, err
	}
	return Verified{Manifest: m, Authenticated: authed}, checkCopy(ctx, m, filepath.Join(tmp, DBFile))
}

// checkCopy checks that the database copy is at the manifest's schema.
func checkCopy(ctx context.Context, m Manifest, dbPath string) error {
	v, err := store.SQLiteSchemaVersion(ctx, dbPath)
	if err != nil {
		return damaged("the database copy: %v", err)
	}
	if v != m.SchemaVersion {
		return damaged("the database copy is at schema version %d, the manifest says %d", v, m.SchemaVersion)
	}
	return nil
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

// checkSchema refuses a backup of a schema newer than this binary knows.
func checkSchema(m Manifest) error {
	known, err := store.KnownSchemaVersion(store.SQLite)
	if err != nil {
		return err
	}
	if m.SchemaVersion > known {
		return errs.New(errs.InvalidState, "the backup's schema version %d is newer than this binary knows (%d): restore it with the better-compute that took it, or a newer one", m.SchemaVersion, known)
	}
	return nil
}

// Restore restores the archive cfg.In into the fresh directory
// cfg.DataDir. Nothing is left half-written: the restore is staged in a
// directory beside the target, removed on any failure, and renamed into
// place last.
func Restore(ctx context.Context, cfg RestoreConfig) (Restored, error) {
	if cfg.In == "" {
		return Restored{}, errs.Invalid("--in", "required")
	}
	if cfg.DataDir == "" {
		return Restored{}, errs.Invalid("--data-dir", "required")
	}
	target, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return Restored{}, err
	}
	existed, err := freshDir(target)
	if err != nil {
		return Restored{}, err
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil {
		return Restored{}, fmt.Errorf("create %s: %w", filepath.Dir(target), err)
	}
	stage, err := os.MkdirTemp(filepath.Dir(target), "."+filepath.Base(target)+".restore-*")
	if err != nil {
		return Restored{}, fmt.Errorf("create the staging directory: %w", err)
	}
	defer os.RemoveAll(stage) // a no-op once renamed into place
	cfg.progress("checking and extracting %s", cfg.In)
	x := extraction{in: cfg.In, auth: cfg.Auth, dir: stage, need: Manifest.size, put: stageWriter(stage)}
	m, authed, err := x.run()
	if err != nil {
		return Restored{}, err
	}
	checked := "MAC and checksums match"
	if !authed {
		checked = "checksums match, NO MAC (unauthenticated)"
	}
	cfg.progress("backup of %s taken %s, schema version %d, %d files: %s", m.TrustDomain, m.CreatedAt.Format(time.RFC3339), m.SchemaVersion, len(m.Files), checked)
	res, err := openRestored(ctx, cfg, m, filepath.Join(stage, DBFile))
	if err != nil {
		return Restored{}, err
	}
	if existed {
		if err := os.Remove(target); err != nil {
			return Restored{}, errs.Wrap(err, errs.AlreadyExists, "--data-dir %s: %v", target, err)
		}
	}
	if err := os.Rename(stage, target); err != nil {
		return Restored{}, fmt.Errorf("move the restore into %s: %w", target, err)
	}
	if err := syncDir(filepath.Dir(target)); err != nil {
		return Restored{}, err
	}
	res.Manifest, res.Authenticated = m, authed
	res.DBPath, res.PKIDir = filepath.Join(target, DBFile), filepath.Join(target, PKIDir)
	return res, nil
}

// freshDir checks that dir is missing or an empty directory, and reports
// whether it exists.
func freshDir(dir string) (bool, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, errs.Wrap(err, errs.AlreadyExists, "--data-dir %s: want a new or empty directory: %v", dir, err)
	}
	if len(ents) > 0 {
		return true, errs.New(errs.AlreadyExists, "--data-dir %s is not empty: a restore only writes a fresh directory", dir)
	}
	return true, nil
}

// stageWriter creates each member's file under stage: the database 0600,
// PKI keys 0600 and the rest 0644 in 0700 directories, as pki init does.
func stageWriter(stage string) func(name string) (io.WriteCloser, error) {
	return func(name string) (io.WriteCloser, error) {
		p := filepath.Join(stage, DBFile)
		mode := os.FileMode(0o600)
		if name != memberDB {
			p = filepath.Join(stage, PKIDir, filepath.FromSlash(name[len(pkiPrefix):]))
			if !isKeyFile(p) {
				mode = 0o644
			}
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			return nil, err
		}
		return os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	}
}

// extraction reads one archive: the manifest first, then its MAC, both
// checked before any member is read, then every member, streamed to the
// writer put returns and checked against the manifest's size and SHA-256.
// Any member missing, extra, repeated, of the wrong kind, altered or
// longer than the manifest says makes the archive damaged.
type extraction struct {
	in   string
	auth Auth
	// dir is where the members are written; need is how many bytes of
	// the manifest's members go there, refused above dir's free space.
	dir  string
	need func(Manifest) int64
	put  func(name string) (io.WriteCloser, error)
}

// run extracts x.in, and reports whether its MAC was checked.
func (x extraction) run() (Manifest, bool, error) {
	f, err := os.Open(x.in)
	if err != nil {
		return Manifest{}, false, errs.Wrap(err, errs.InvalidArgument, "--in: %v", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return Manifest{}, false, damaged("%v", err)
	}
	tr := tar.NewReader(zr)
	m, authed, next, err := x.manifest(tr)
	if err != nil {
		return m, false, err
	}
	if err := checkSchema(m); err != nil {
		return m, false, err
	}
	if err := checkSpace(x.dir, x.need(m)); err != nil {
		return m, false, err
	}
	seen := map[string]bool{}
	for hdr := next; ; {
		if hdr == nil {
			if hdr, err = tr.Next(); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				return m, false, damaged("%v", err)
			}
		}
		want, ok := m.file(hdr.Name)
		if !ok || seen[hdr.Name] || hdr.Typeflag != tar.TypeReg || hdr.Size != want.Size {
			return m, false, damaged("member %q is not in the manifest as it is", hdr.Name)
		}
		seen[hdr.Name] = true
		if err := copyMember(tr, want, x.put); err != nil {
			return m, false, err
		}
		hdr = nil
	}
	if len(seen) != len(m.Files) {
		return m, false, damaged("%d of the manifest's %d members are missing", len(m.Files)-len(seen), len(m.Files))
	}
	// Reading to the end checks gzip's own checksum of the whole stream.
	if _, err := io.Copy(io.Discard, zr); err != nil {
		return m, false, damaged("%v", err)
	}
	return m, authed, nil
}

// manifest reads manifest.json and manifest.mac, checks the MAC and parses
// the manifest. next is the member after them, already read, when the
// archive has no MAC (and x.auth accepts that).
func (x extraction) manifest(tr *tar.Reader) (m Manifest, authed bool, next *tar.Header, err error) {
	raw, err := readSmall(tr, memberManifest, maxManifestBytes)
	if err != nil {
		return m, false, nil, err
	}
	if err := checkFormat(raw); err != nil {
		return m, false, nil, err
	}
	next, err = tr.Next()
	if err != nil && !errors.Is(err, io.EOF) {
		return m, false, nil, damaged("%v", err)
	}
	if next != nil && next.Name == memberMAC {
		mac, err := readMember(tr, next, memberMAC, maxMACBytes)
		if err != nil {
			return m, false, nil, err
		}
		if err := checkManifestMAC(raw, mac, x.auth.Secret); err != nil {
			return m, false, nil, err
		}
		authed, next = true, nil
	} else if !x.auth.Unauthenticated {
		return m, false, nil, errNoMAC()
	}
	m, err = parseManifest(raw, authed)
	return m, authed, next, err
}

// readSmall reads the next member, which must be name, whole.
func readSmall(tr *tar.Reader, name string, limit int64) ([]byte, error) {
	hdr, err := tr.Next()
	if err != nil {
		return nil, damaged("the archive has no %s: %v", name, err)
	}
	return readMember(tr, hdr, name, limit)
}

// readMember reads the member of hdr, which must be name, a regular file
// of at most limit bytes, whole.
func readMember(tr *tar.Reader, hdr *tar.Header, name string, limit int64) ([]byte, error) {
	if hdr.Name != name || hdr.Typeflag != tar.TypeReg || hdr.Size > limit {
		return nil, damaged("member %q where %s (at most %d bytes) belongs", hdr.Name, name, limit)
	}
	raw, err := io.ReadAll(io.LimitReader(tr, limit+1))
	if err != nil {
		return nil, damaged("%s: %v", name, err)
	}
	if int64(len(raw)) > limit {
		return nil, damaged("%s is over %d bytes", name, limit)
	}
	return raw, nil
}

// checkSpace refuses to write need bytes into dir when its file system
// has less free: a restore stops before it fills the disk, however well a
// hostile archive compresses.
func checkSpace(dir string, need int64) error {
	free, ok := freeBytes(dir)
	if ok && need > free {
		return errs.New(errs.InvalidState, "the backup's files take %d bytes and %s has %d free: free space, or restore elsewhere", need, dir, free)
	}
	return nil
}

func copyMember(r io.Reader, want File, put func(string) (io.WriteCloser, error)) error {
	w, err := put(want.Name)
	if err != nil {
		return fmt.Errorf("extract %s: %w", want.Name, err)
	}
	h := sha256.New()
	// One byte more than the manifest says is read, to notice a longer
	// member: at most that byte is written past the declared size before
	// the member is refused (and the staging directory removed).
	n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(r, want.Size+1))
	err = errors.Join(err, w.Close())
	var e *errs.E
	switch {
	case errors.As(err, &e):
		return err
	case err != nil && n != want.Size:
		return damaged("%s: %v", want.Name, err)
	case err != nil:
		return fmt.Errorf("extract %s: %w", want.Name, err)
	case n > want.Size:
		return damaged("%s is longer than the %d bytes the manifest says", want.Name, want.Size)
	case n != want.Size:
		return damaged("%s is %d bytes, the manifest says %d", want.Name, n, want.Size)
	case hex.EncodeToString(h.Sum(nil)) != want.SHA256:
		return damaged("%s does not match its SHA-256 in the manifest", want.Name)
	}
	return nil
}

// openRestored opens the staged database (migrating an older schema to
// this binary's), checks it is what the manifest says, and revokes the
// join tokens live in it unless cfg.KeepTokens, with an event and an audit
// row each and an audit row of the restore in every tenant.
func openRestored(ctx context.Context, cfg RestoreConfig, m Manifest, dbPath string) (Restored, error) {
	var res Restored
	if err := checkCopy(ctx, m, dbPath); err != nil {
		return res, err
	}
	db, err := store.Open(ctx, store.Config{Driver: string(store.SQLite), Path: dbPath}, cfg.Log)
	if err != nil {
		return res, fmt.Errorf("open the restored database: %w", err)
	}
	defer db.Close()
	if res.SchemaVersion, err = db.SchemaVersion(ctx); err != nil {
		return res, err
	}
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		res.RevokedTokens = nil
		if !cfg.KeepTokens {
			if res.RevokedTokens, err = tx.RevokeLiveJoinTokens(ctx); err != nil {
				return err
			}
		}
		// The backup's sessions are gone: without this the API showed
		// those nodes connected until each was noticed missing.
		if _, err := tx.DisconnectAll(ctx); err != nil {
			return err
		}
		sum, err := tx.Summary(ctx)
		if err != nil {
			return err
		}
		res.Nodes = sum.Nodes
		return recordRestore(ctx, tx, m, cfg.KeepTokens, res.RevokedTokens, sum.Tenants)
	})
	if err != nil {
		return res, err
	}
	if err := db.Close(); err != nil {
		return res, fmt.Errorf("close the restored database: %w", err)
	}
	return res, nil
}

// recordRestore writes what the restore did into the restored database:
// security.join-token.revoked and its audit row per token, as a revocation
// through the API does, and a controlplane.restored audit row per tenant.
func recordRestore(ctx context.Context, tx *store.Tx, m Manifest, keep bool, revoked []store.JoinToken, tenants []string) error {
	perTenant := map[string]int{}
	for _, j := range revoked {
		perTenant[j.TenantID]++
		data := map[string]any{"tokenId": j.ID, "poolId": j.PoolID, "usesLeft": j.UsesLeft, "revokedBy": "restore"}
		if err := events.Publish(ctx, tx, nil, events.Event{TenantID: j.TenantID, Type: "security.join-token.revoked", Subject: j.ID, Data: data}); err != nil {
			return err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: j.TenantID, Actor: restoreActor, Action: "join-token.revoked", Resource: authz.PoolResource(j.PoolID), Data: data}); err != nil {
			return err
		}
	}
	for _, tn := range tenants {
		data := map[string]any{"backupCreatedAt": m.CreatedAt, "schemaVersion": m.SchemaVersion, "tokensRevoked": perTenant[tn], "keepTokens": keep}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: tn, Actor: restoreActor, Action: "controlplane.restored", Resource: "controlplane", Data: data}); err != nil {
			return err
		}
	}
	return nil
}
