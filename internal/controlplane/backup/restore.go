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

// Restored is what Restore did.
type Restored struct {
	Manifest Manifest
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

// Verify reads the whole archive at in and checks it against its manifest,
// and that the database copy is at the manifest's schema version. It
// writes nothing but a temporary copy of the database, removed before it
// returns.
func Verify(ctx context.Context, in string) (Manifest, error) {
	tmp, err := os.MkdirTemp("", "bc-verify-*")
	if err != nil {
		return Manifest{}, err
	}
	defer os.RemoveAll(tmp)
	put := func(name string) (io.WriteCloser, error) {
		if name == memberDB {
			return os.OpenFile(filepath.Join(tmp, DBFile), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		}
		return nopCloser{io.Discard}, nil
	}
	m, err := extract(in, checkSchema, put)
	if err != nil {
		return m, err
	}
	return m, checkCopy(ctx, m, filepath.Join(tmp, DBFile))
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
	m, err := extract(cfg.In, checkSchema, stageWriter(stage))
	if err != nil {
		return Restored{}, err
	}
	cfg.progress("backup of %s taken %s, schema version %d, %d files: checksums match", m.TrustDomain, m.CreatedAt.Format(time.RFC3339), m.SchemaVersion, len(m.Files))
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
	res.Manifest = m
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

// extract reads the archive at in: the manifest first, checked by check
// before any member is read, then every member, streamed to the writer
// put returns and checked against the manifest's size and SHA-256. Any
// member missing, extra, repeated, of the wrong kind or altered makes the
// archive damaged.
func extract(in string, check func(Manifest) error, put func(name string) (io.WriteCloser, error)) (Manifest, error) {
	f, err := os.Open(in)
	if err != nil {
		return Manifest{}, errs.Wrap(err, errs.InvalidArgument, "--in: %v", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return Manifest{}, damaged("%v", err)
	}
	tr := tar.NewReader(zr)
	hdr, err := tr.Next()
	if err != nil || hdr.Name != memberManifest || hdr.Typeflag != tar.TypeReg || hdr.Size > maxManifestBytes {
		return Manifest{}, damaged("the first member is not %s", memberManifest)
	}
	raw, err := io.ReadAll(io.LimitReader(tr, maxManifestBytes))
	if err != nil {
		return Manifest{}, damaged("%s: %v", memberManifest, err)
	}
	m, err := parseManifest(raw)
	if err != nil {
		return m, err
	}
	if err := check(m); err != nil {
		return m, err
	}
	seen := map[string]bool{}
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return m, damaged("%v", err)
		}
		want, ok := m.file(hdr.Name)
		if !ok || seen[hdr.Name] || hdr.Typeflag != tar.TypeReg || hdr.Size != want.Size {
			return m, damaged("member %q is not in the manifest as it is", hdr.Name)
		}
		seen[hdr.Name] = true
		if err := copyMember(tr, want, put); err != nil {
			return m, err
		}
	}
	if len(seen) != len(m.Files) {
		return m, damaged("%d of the manifest's %d members are missing", len(m.Files)-len(seen), len(m.Files))
	}
	// Reading to the end checks gzip's own checksum of the whole stream.
	if _, err := io.Copy(io.Discard, zr); err != nil {
		return m, damaged("%v", err)
	}
	return m, nil
}

func copyMember(r io.Reader, want File, put func(string) (io.WriteCloser, error)) error {
	w, err := put(want.Name)
	if err != nil {
		return fmt.Errorf("extract %s: %w", want.Name, err)
	}
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(r, want.Size))
	err = errors.Join(err, w.Close())
	var e *errs.E
	switch {
	case errors.As(err, &e):
		return err
	case err != nil && n != want.Size:
		return damaged("%s: %v", want.Name, err)
	case err != nil:
		return fmt.Errorf("extract %s: %w", want.Name, err)
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
