package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/controlplane/backup"
	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// backupCmds are `backup` and `restore` (R16.3): they read the server's
// files directly, not through the API.
func (a *app) backupCmds() []*cobra.Command { return []*cobra.Command{a.backupCmd(), a.restoreCmd()} }

func (a *app) progress(format string, args ...any) {
	fmt.Fprintf(a.env.Stderr, format+"\n", args...)
}

func (a *app) backupCmd() *cobra.Command {
	var path, dataDir, out string
	cmd := &cobra.Command{
		Use:   "backup (--config FILE | --data-dir DIR) --out FILE",
		Short: "Back up the control plane's database and PKI files while it runs",
		Long: `Write one archive (tar.gz, 0600) of serve's SQLite database, copied
consistently while the server keeps running (VACUUM INTO), and of the PKI
directory's public and encrypted files (pki.dir), with a manifest of the
schema version and each file's SHA-256, and the manifest's MAC (HMAC-SHA256
under a key derived from BETTER_COMPUTE_SECRET), so that restore takes only
an archive made by someone holding the secret. --config is serve's config;
--data-dir is a 'dev' (or restored) data directory: DIR/bc.db and DIR/pki. The
archive is written beside --out and moved into place; an existing --out is
never overwritten.

BETTER_COMPUTE_SECRET must be set (with --data-dir, DIR/dev-secret is used
when the directory has one, as dev does) and is not in the archive: keep it apart (a password
manager, a secret store); restore needs it. PostgreSQL is backed up with pg_dump
or point-in-time recovery plus a copy of pki.dir: see
docs/operations/backup-restore.md.

Progress goes to stderr; --json prints the manifest on stdout.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := required("out", out); err != nil {
				return err
			}
			if err := outDirExists(out); err != nil {
				return err
			}
			st, pkiDir, err := backupSource(path, dataDir)
			if err != nil {
				return err
			}
			sec, err := backupSecret(a.env.Getenv(SecretEnv), dataDir)
			if err != nil {
				return err
			}
			m, err := backup.Create(cmd.Context(), backup.Config{Store: st, PKIDir: pkiDir, Out: out, Secret: sec, Progress: a.progress})
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(m)
			}
			fmt.Fprintf(a.env.Stdout, "wrote %s: schema version %d, %d files, taken %s\n", out, m.SchemaVersion, len(m.Files), m.CreatedAt.Format(time.RFC3339))
			return nil
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "serve's TOML config file")
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "a dev or restored data directory instead of --config")
	cmd.Flags().StringVar(&out, "out", "", "archive to write (must not exist)")
	return cmd
}

// backupSource is the database and PKI directory of serve's config, or of
// a data directory laid out as dev and restore write it.
func backupSource(config, dataDir string) (store.Config, string, error) {
	switch {
	case (config == "") == (dataDir == ""):
		return store.Config{}, "", errs.Invalid("--config", "give --config (serve's config) or --data-dir, not both")
	case dataDir != "":
		return store.Config{Driver: string(store.SQLite), Path: filepath.Join(dataDir, backup.DBFile)}, filepath.Join(dataDir, backup.PKIDir), nil
	}
	cfg, err := server.LoadConfig(config)
	if err != nil {
		return store.Config{}, "", err
	}
	return cfg.Store, cfg.PKI.Dir, nil
}

// backupSecret is, for a dev data directory, the secret dev keeps in it
// (DIR/dev-secret, the one its keys are under, which dev uses even when
// BETTER_COMPUTE_SECRET is exported), else BETTER_COMPUTE_SECRET. It never
// makes one: a backup of a directory without either has nothing to
// authenticate under.
func backupSecret(env, dataDir string) ([]byte, error) {
	if dataDir == "" {
		return []byte(env), nil
	}
	b, err := os.ReadFile(filepath.Join(dataDir, "dev-secret"))
	if errors.Is(err, fs.ErrNotExist) {
		return []byte(env), nil
	}
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "read the dev secret: %v", err)
	}
	return []byte(strings.TrimSpace(string(b))), nil
}

// unauthenticatedWarning is printed on stderr whenever an archive without
// a MAC is read.
const unauthenticatedWarning = `WARNING: this archive carries no MAC (written by an older release, or
stripped of it). Nothing shows it is the archive 'better-compute backup'
wrote: anyone who could write it could have changed the database, its API
keys and grants. Use it only if you know where it has been.`

// restoreSummary is restore's --json answer.
type restoreSummary struct {
	Manifest      backup.Manifest `json:"manifest"`
	DBPath        string          `json:"dbPath,omitempty"`
	PKIDir        string          `json:"pkiDir,omitempty"`
	SchemaVersion int64           `json:"schemaVersion"`
	RevokedTokens []string        `json:"revokedTokens"`
	Nodes         int64           `json:"nodes"`
	Verified      bool            `json:"verifiedOnly,omitempty"`
	Authenticated bool            `json:"authenticated"`
}

func (a *app) restoreCmd() *cobra.Command {
	var in, dir string
	var keep, verify, known, unauth bool
	cmd := &cobra.Command{
		Use:   "restore --in FILE --data-dir DIR",
		Short: "Restore a backup into a fresh data directory",
		Long: `Restore an archive written by 'better-compute backup' into DIR, which must
not exist or be empty: DIR/bc.db (store.path) and DIR/pki (pki.dir). The
archive's MAC is checked under BETTER_COMPUTE_SECRET (the secret it was
taken under), then every file against the manifest (size and SHA-256); a
schema newer than this binary is refused, and so is an archive whose files
take more than the free space. An archive of an older release has no MAC:
it restores only with --unauthenticated, and with a warning. Nothing is left half-written:
the restore is staged beside DIR and renamed into place.

Every join token that was live in the backup is revoked, because uses spent
after the backup are unspent in it (--keep-tokens keeps them: only when
nothing joined since the backup). Machines that joined or renewed after the
backup hold certificates the restored control plane does not know: they
join again with a new token (one with --allow-reclaim takes a renewed
machine back as its node); see docs/operations/backup-restore.md.

--verify only checks the archive and prints its manifest. --known-schema
prints the newest schema version this binary runs (compare a PostgreSQL
dump's: SELECT max(version_id) FROM goose_db_version WHERE is_applied).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if known {
				v, err := store.KnownSchemaVersion(store.SQLite)
				if err != nil {
					return err
				}
				if a.wantJSON() {
					return a.printJSON(map[string]int64{"schemaVersion": v})
				}
				fmt.Fprintln(a.env.Stdout, v)
				return nil
			}
			if err := required("in", in); err != nil {
				return err
			}
			auth := backup.Auth{Secret: []byte(a.env.Getenv(SecretEnv)), Unauthenticated: unauth}
			if verify {
				v, err := backup.Verify(cmd.Context(), in, auth)
				if err != nil {
					return err
				}
				a.warnUnauthenticated(v.Authenticated)
				return a.printRestore(restoreSummary{Manifest: v.Manifest, SchemaVersion: v.Manifest.SchemaVersion, Verified: true, Authenticated: v.Authenticated})
			}
			if err := required("data-dir", dir); err != nil {
				return err
			}
			res, err := backup.Restore(cmd.Context(), backup.RestoreConfig{In: in, DataDir: dir, KeepTokens: keep, Auth: auth, Progress: a.progress})
			if err != nil {
				return err
			}
			a.warnUnauthenticated(res.Authenticated)
			s := restoreSummary{Manifest: res.Manifest, DBPath: res.DBPath, PKIDir: res.PKIDir, SchemaVersion: res.SchemaVersion, Nodes: res.Nodes, RevokedTokens: []string{}, Authenticated: res.Authenticated}
			for _, j := range res.RevokedTokens {
				s.RevokedTokens = append(s.RevokedTokens, j.ID)
			}
			return a.printRestore(s)
		},
	}
	f := cmd.Flags()
	f.StringVar(&in, "in", "", "archive written by better-compute backup")
	f.StringVar(&dir, "data-dir", "", "directory to restore into (new or empty)")
	f.BoolVar(&keep, "keep-tokens", false, "keep the join tokens live in the backup live (only if nothing joined since)")
	f.BoolVar(&verify, "verify", false, "only check the archive against its manifest; write nothing")
	f.BoolVar(&known, "known-schema", false, "print the newest schema version this binary runs and exit")
	f.BoolVar(&unauth, "unauthenticated", false, "accept an archive without a MAC (from an older release); only one you know where it has been")
	return cmd
}

func (a *app) warnUnauthenticated(authenticated bool) {
	if !authenticated {
		fmt.Fprintln(a.env.Stderr, unauthenticatedWarning)
	}
}

func (a *app) printRestore(s restoreSummary) error {
	if a.wantJSON() {
		return a.printJSON(s)
	}
	w, m := a.env.Stdout, s.Manifest
	known, err := store.KnownSchemaVersion(store.SQLite)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "backup taken %s: trust domain %s, schema version %d (this binary knows up to %d), %d files\n",
		m.CreatedAt.Format(time.RFC3339), m.TrustDomain, m.SchemaVersion, known, len(m.Files))
	if s.Verified {
		if s.Authenticated {
			fmt.Fprintln(w, "the archive is authenticated under BETTER_COMPUTE_SECRET and matches its manifest")
		} else {
			fmt.Fprintln(w, "the archive matches its manifest, but is NOT authenticated (no MAC)")
		}
		return nil
	}
	fmt.Fprintf(w, "restored into:\n  store.path = %q\n  pki.dir    = %q\n", s.DBPath, s.PKIDir)
	fmt.Fprintf(w, "revoked %d join tokens that were live in the backup; mint new ones for machines still to join\n", len(s.RevokedTokens))
	fmt.Fprintf(w, `nodes: the backup knows %d. Machines that changed after %s:
  - joined after it: unknown here; their renewals, sessions and x509pop
    re-joins are refused. Join each again with a new token (bcd join): it
    becomes a new node.
  - renewed after it: their newer certificate is unknown here and refused
    the same way. Join each again with a new token made with
    --allow-reclaim: it takes back its node (same id, next generation).
  - removed or retired after it: are back; remove them again.
API keys revoked after it are live again: revoke them again before serving.
Start serve on these paths with BETTER_COMPUTE_SECRET set to the secret of
the backed-up PKI.
`, s.Nodes, m.CreatedAt.Format(time.RFC3339))
	return nil
}

// outDirExists refuses an --out whose directory does not exist, with the
// product's code, before anything is read.
func outDirExists(out string) error {
	dir := filepath.Dir(out)
	st, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return errs.Invalid("--out", "the directory %s does not exist: create it first (mkdir -p %s)", dir, dir)
	case err != nil:
		return errs.Invalid("--out", "%v", err)
	case !st.IsDir():
		return errs.Invalid("--out", "%s is not a directory", dir)
	}
	return nil
}
