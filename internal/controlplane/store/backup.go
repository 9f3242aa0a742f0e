package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/better-compute/better-compute/internal/controlplane/store/engine"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// What backup and restore need of the database (R16.3): a consistent copy
// of a SQLite file that a server keeps writing, the schema version of a
// database and of this binary, and the revocation of every live join token
// of a restored copy. The archive itself is internal/controlplane/backup's.

// KnownSchemaVersion is the highest migration this binary carries for d: a
// database whose schema is newer was written by a newer binary, and this one
// must not run (or restore) it.
func KnownSchemaVersion(d Dialect) (int64, error) {
	ents, err := fs.ReadDir(migrations, "migrations/"+string(d))
	if err != nil {
		return 0, fmt.Errorf("migrations: %w", err)
	}
	// goose's naming: NNNNN_name.sql, versioned by the leading number.
	var v int64
	for _, e := range ents {
		num, _, ok := strings.Cut(e.Name(), "_")
		n, err := strconv.ParseInt(num, 10, 64)
		if !ok || err != nil || !strings.HasSuffix(e.Name(), ".sql") {
			return 0, fmt.Errorf("migrations: %s is not NNNNN_name.sql", e.Name())
		}
		v = max(v, n)
	}
	return v, nil
}

// schemaVersion reads the highest migration applied to h from goose's
// table.
func schemaVersion(ctx context.Context, h *sql.DB) (int64, error) {
	var v sql.NullInt64
	err := h.QueryRowContext(ctx, "SELECT MAX(version_id) FROM goose_db_version WHERE is_applied").Scan(&v)
	if err != nil {
		return 0, fmt.Errorf("read the schema version: %w", err)
	}
	return v.Int64, nil
}

// SchemaVersion reads the highest migration applied to the database.
func (db *DB) SchemaVersion(ctx context.Context) (int64, error) {
	return schemaVersion(ctx, db.e.Pool())
}

// openSQLiteFile opens an existing SQLite file without migrating it (mode=rw
// never creates one: a wrong path must not leave an empty database behind).
func openSQLiteFile(path string) (*sql.DB, error) {
	if _, err := os.Stat(path); err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "store.path %s: %v", path, err)
	}
	dsn := "file:" + filepath.ToSlash(path) + "?" + url.Values{
		"mode":    {"rw"},
		"_pragma": {"busy_timeout(10000)"},
	}.Encode()
	h, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, fmt.Errorf("open sqlite: %w", err)
	}
	h.SetMaxOpenConns(1)
	return h, nil
}

// SQLiteSchemaVersion reads the schema version of the SQLite file at path
// without migrating it.
func SQLiteSchemaVersion(ctx context.Context, path string) (int64, error) {
	h, err := openSQLiteFile(path)
	if err != nil {
		return 0, err
	}
	defer h.Close()
	return schemaVersion(ctx, h)
}

// SnapshotSQLite writes a consistent copy of the SQLite database cfg names
// to dst, which must not exist, and returns the copy's schema version. It
// runs while a server keeps writing: VACUUM INTO reads one snapshot (a
// read transaction, which in WAL mode blocks no writer) and writes a
// compacted database holding exactly the commits before it. It never
// migrates the source: the server that owns it does.
//
// SECURITY: dst holds what the database holds (key and token hashes, the
// audit trail): it is created 0600 before SQLite writes into it.
func SnapshotSQLite(ctx context.Context, cfg Config, dst string) (int64, error) {
	if cfg.Driver != "" && cfg.Driver != string(SQLite) {
		return 0, errs.New(errs.InvalidState, "store.driver %q: only SQLite is copied by better-compute backup; back PostgreSQL up with pg_dump or point-in-time recovery (docs/operations/backup-restore.md)", cfg.Driver)
	}
	if cfg.Path == "" {
		return 0, errs.New(errs.InvalidConfig, "store.path: the SQLite database file is required")
	}
	if _, err := os.Lstat(dst); !errors.Is(err, fs.ErrNotExist) {
		return 0, fmt.Errorf("snapshot target %s exists", dst)
	}
	h, err := openSQLiteFile(cfg.Path)
	if err != nil {
		return 0, err
	}
	defer h.Close()
	if _, err := h.ExecContext(ctx, "VACUUM INTO ?", dst); err != nil {
		_ = os.Remove(dst)
		return 0, engine.Unavailable(fmt.Errorf("copy the database: %w", err))
	}
	if err := os.Chmod(dst, 0o600); err != nil {
		_ = os.Remove(dst)
		return 0, fmt.Errorf("make the copy owner-only: %w", err)
	}
	return SQLiteSchemaVersion(ctx, dst)
}

// RevokeLiveJoinTokens revokes every join token live at compute_now() and
// returns them as they were (with their uses left). A restored database
// calls it: a use spent after the backup was taken is unspent in the copy,
// and must not be spendable a second time (R16.3).
func (t *Tx) RevokeLiveJoinTokens(ctx context.Context) ([]JoinToken, error) {
	rows, err := t.query(ctx, "SELECT "+tokenCols+" FROM join_tokens WHERE revoked_ms IS NULL AND expires_ms > compute_now() AND "+usesLeft+" > 0 ORDER BY id")
	if err != nil {
		return nil, fmt.Errorf("list live join tokens: %w", err)
	}
	var live []JoinToken
	for rows.Next() {
		j, err := scanToken(rows)
		if err != nil {
			rows.Close()
			return nil, err
		}
		live = append(live, j)
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return nil, fmt.Errorf("list live join tokens: %w", err)
	}
	for _, j := range live {
		if _, err := t.RevokeJoinToken(ctx, j.ID); err != nil {
			return nil, err
		}
	}
	return live, nil
}

// StoreSummary is what a restore reports of the nodes it restored.
type StoreSummary struct {
	Nodes int64
	// Tenants are the ids of every tenant, for the audit rows a restore
	// writes.
	Tenants []string
}

// Summary counts the nodes and lists the tenants.
func (t *Tx) Summary(ctx context.Context) (StoreSummary, error) {
	var s StoreSummary
	if err := t.queryRow(ctx, "SELECT COUNT(*) FROM nodes").Scan(&s.Nodes); err != nil {
		return s, fmt.Errorf("count nodes: %w", err)
	}
	rows, err := t.query(ctx, "SELECT id FROM tenants ORDER BY id")
	if err != nil {
		return s, fmt.Errorf("list tenants: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return s, err
		}
		s.Tenants = append(s.Tenants, id)
	}
	return s, rows.Err()
}
