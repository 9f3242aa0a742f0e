package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// NewSecretEnv holds the next secret while BETTER_COMPUTE_SECRET rotates.
const NewSecretEnv = "BETTER_COMPUTE_NEW_SECRET"

// deployment is what the rotation commands act on: the server's database
// and PKI directory, from its config file or a dev data directory.
type deployment struct {
	config, dev string
	// sqlite and pkiDir, when set, name a SQLite database found beside a
	// PKI directory given with --dir (see besideDir); no flag sets them.
	sqlite, pkiDir string
}

func (d *deployment) flags(cmd *cobra.Command) {
	cmd.Flags().StringVar(&d.config, "config", "", "the server's TOML config (its [store] and [pki] dir)")
	cmd.Flags().StringVar(&d.dev, "dev", "", "a `better-compute dev` data directory instead of --config")
}

// open returns the store and the PKI directory, and the secret: from
// $BETTER_COMPUTE_SECRET, or dev's own secret file for --dev.
func (a *app) openDeployment(ctx context.Context, d deployment, needSecret bool) (*store.DB, string, []byte, error) {
	var sc store.Config
	var pkiDir string
	var sec []byte
	switch {
	case d.config != "" && d.dev != "":
		return nil, "", nil, errs.Invalid("--dev", "give --config or --dev, not both")
	case d.config != "":
		cfg, err := server.LoadConfig(d.config)
		if err != nil {
			return nil, "", nil, err
		}
		if cfg.PKI.Dir == "" {
			return nil, "", nil, errs.New(errs.InvalidConfig, "%s has no [pki] dir: there are no keys to rotate", d.config)
		}
		sc, pkiDir = cfg.Store, cfg.PKI.Dir
		if needSecret {
			var err error
			if sec, err = a.secret(); err != nil {
				return nil, "", nil, err
			}
		}
	case d.sqlite != "":
		sc, pkiDir = store.Config{Driver: "sqlite", Path: d.sqlite}, d.pkiDir
		if needSecret {
			var err error
			if sec, err = a.secret(); err != nil {
				return nil, "", nil, err
			}
		}
	case d.dev != "":
		dir, err := filepath.Abs(d.dev)
		if err != nil {
			return nil, "", nil, err
		}
		sc, pkiDir = store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}, filepath.Join(dir, "pki")
		if sec, _, err = devSecret(dir, a.env.Getenv(SecretEnv)); err != nil {
			return nil, "", nil, err
		}
	default:
		return nil, "", nil, errs.Invalid("--config", "give the server's --config (or --dev DIR for a dev control plane)")
	}
	db, err := store.Open(ctx, sc, slog.New(slog.DiscardHandler))
	if err != nil {
		return nil, "", nil, err
	}
	return db, pkiDir, sec, nil
}

// dbFile is the SQLite database's name beside the PKI directory, in dev's
// data directory and in the default install (/var/lib/better-compute).
const dbFile = "bc.db"

// besideDir returns the deployment of a PKI directory given with --dir
// when its database sits beside it (DIR/../bc.db): the PKI directory keeps
// the first generation of every key, so after a rotation only the database
// knows the keys in force, and a --dir form must read them there.
func besideDir(pkiDir string) (deployment, bool) {
	abs, err := filepath.Abs(pkiDir)
	if err != nil {
		return deployment{}, false
	}
	db := filepath.Join(filepath.Dir(abs), dbFile)
	if st, err := os.Stat(db); err != nil || !st.Mode().IsRegular() {
		return deployment{}, false
	}
	return deployment{sqlite: db, pkiDir: abs}, true
}

// dirKeys returns the keys in force for a --dir form: the database's when
// one sits beside the directory and holds keys, else nil, and then a note
// goes to standard error that the directory's keys are the first
// generation and which command reads the ones in force.
func (a *app) dirKeys(ctx context.Context, pkiDir, cmdName string) (*rotation.Public, error) {
	if d, ok := besideDir(pkiDir); ok {
		pub, err := a.publicKeys(ctx, d)
		switch {
		case err == nil:
			return &pub, nil
		case !errors.Is(err, rotation.ErrNoKeys):
			return nil, err
		}
		// No server has run on that database yet: nothing has rotated.
		return nil, nil
	}
	if _, err := os.Stat(filepath.Join(pkiDir, ca.FileManifest)); err != nil {
		return nil, nil // no bundle: the caller's load says so
	}
	fmt.Fprintf(a.env.Stderr, "note: these are %s's own keys, the first generation; once any key has rotated, run %s --config FILE (the server's config) for the keys in force\n", pkiDir, cmdName)
	return nil, nil
}

func (a *app) pkiRotateCmd() *cobra.Command {
	var d deployment
	var phase string
	var force bool
	cmd := &cobra.Command{
		Use:   "rotate KEY --phase prepare|activate|retire|rollback --config FILE",
		Short: "Rotate one key of the machine PKI, one phase at a time",
		Long: `Rotate a key of the machine PKI without reinstalling a machine. KEY is
node-ca, serving-ca, join-signing, join-encryption, command-signing, or
secret (BETTER_COMPUTE_SECRET itself, below). Each phase is one transaction
in the database; every API replica picks it up within a few seconds, no
restart.

  prepare   make the next key. It is trusted and announced (daemons learn it
            from their next renewal, session or join, as a statement the
            current key signs) but nothing is signed with it.
  activate  new signatures use it; the old key is still accepted.
  retire    the old key is no longer accepted (daemons are told to drop it).
  rollback  after activate: the old key signs again and the new one is
            dropped; after prepare: the prepared key is dropped.

Between phases, watch 'pki status': wait until no node is behind (about one
certificate lifetime) before activate and again before retire. A node is
behind until its daemon has said, in a signed session Hello, that it holds
the keys in force; retire refuses while any node is behind and names them,
unless --force. Daemons follow even a rotation run back to back (each
answer carries the chain from the keys they pin). A certificate of a
retired node CA opens no session (a held one ends) but still renews onto
the new CA: nodes behind a node-ca retire forced through are without a
session until their next renewal. After
activating serving-ca, issue new gateway certificates (pki issue-gateway)
and agent certificates; gateways and the API load them without a restart.

The secret: prepare (with the new one in $BETTER_COMPUTE_NEW_SECRET)
encrypts every key under it too, in the database and the PKI directory
(<key file>.next); activate makes those the primary copies; then restart
each replica with BETTER_COMPUTE_SECRET set to the new secret (a replica
on either secret opens every key until retire) and copy the PKI directory
to replicas that have their own; retire deletes the old copies. No key
rotates meanwhile, and daemons see nothing.

An event and an audit row (pki.key.prepared, .activated, .retired,
.rolled-back) record every phase in the root tenant.`,
		Example: `  better-compute pki rotate join-signing --phase prepare --config /etc/better-compute/config.toml
  better-compute pki status --config /etc/better-compute/config.toml
  better-compute pki rotate join-signing --phase activate --config /etc/better-compute/config.toml`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("phase", phase); err != nil {
				return err
			}
			ctx := cmd.Context()
			db, pkiDir, sec, err := a.openDeployment(ctx, d, true)
			if err != nil {
				return err
			}
			defer db.Close()
			base, err := ca.Load(pkiDir, sec)
			if err != nil {
				return err
			}
			var res rotation.Result
			if args[0] == rotation.KindSecret {
				op := rotation.SecretOp{Phase: phase, Secret: sec, PKIDir: pkiDir, Actor: actor(), Now: time.Now()}
				if phase == rotation.PhasePrepare {
					if op.Next = []byte(a.env.Getenv(NewSecretEnv)); len(op.Next) == 0 {
						return errs.New(errs.InvalidConfig, "%s is not set: put the new secret there (better-compute pki generate-secret makes one)", NewSecretEnv)
					}
				}
				res, err = rotation.RotateSecret(ctx, db, base, op)
			} else {
				res, err = rotation.Rotate(ctx, db, base, sec, rotation.Op{Kind: args[0], Phase: phase, Actor: actor(), Now: time.Now(), Force: force})
			}
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(res)
			}
			fmt.Fprintf(a.env.Stdout, "%s: %s generation %d (%s); generation %d signs\n", res.Kind, pastOf(res.Phase), res.Gen, res.Fingerprint, res.Current)
			fmt.Fprintf(a.env.Stdout, "replicas pick it up within %s; follow with: better-compute pki status\n", rotation.DefaultPoll)
			return nil
		},
	}
	d.flags(cmd)
	cmd.Flags().StringVar(&phase, "phase", "", "prepare, activate, retire or rollback")
	cmd.Flags().BoolVar(&force, "force", false, "retire though pki status shows nodes behind (they catch up at their next renewal; behind a node-ca retire they have no session until then)")
	return cmd
}

func pastOf(phase string) string {
	return map[string]string{rotation.PhasePrepare: "prepared", rotation.PhaseActivate: "activated", rotation.PhaseRetire: "retired", rotation.PhaseRollback: "rolled back"}[phase]
}

// actor names the person running the command, for the audit row.
func actor() string {
	if u, err := user.Current(); err == nil && u.Username != "" {
		return "cli:" + u.Username
	}
	return "cli"
}

func (a *app) pkiStatusCmd() *cobra.Command {
	var d deployment
	cmd := &cobra.Command{
		Use:   "status --config FILE",
		Short: "Show every key of the machine PKI: generations, fingerprints, who is behind",
		Long: `Show each key's generations (next, current, previous, retired,
discarded) with fingerprints (pins), creation and expiry, and how many live
nodes are behind: for the node CA, nodes whose certificate an older CA
issued; for the keys daemons pin (serving-ca, join-signing,
join-encryption), nodes whose daemon has not said, signed, in a session
Hello or a renewal, that it holds the current and next keys; for
command-signing, nodes that have not renewed since the newest generation
was made. --json names up to 20 of them per key (behindNodes). Needs no
secret.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			db, _, _, err := a.openDeployment(ctx, d, false)
			if err != nil {
				return err
			}
			defer db.Close()
			st, err := rotation.Status(ctx, db, time.Now())
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(map[string]any{"keys": st})
			}
			a.printStatus(st)
			return nil
		},
	}
	d.flags(cmd)
	return cmd
}

func (a *app) printStatus(st []rotation.KeyStatus) {
	if len(st) > 0 && len(st[0].Generations) == 0 {
		fmt.Fprintln(a.env.Stdout, "no keys in the database yet: start the server once (it records the PKI directory's keys)")
		return
	}
	w := tabwriter.NewWriter(a.env.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "KEY\tGEN\tSTATE\tFINGERPRINT\tCREATED\tEXPIRES\tBEHIND")
	for _, k := range st {
		for _, g := range k.Generations {
			exp := "-"
			if !g.NotAfter.IsZero() {
				exp = g.NotAfter.UTC().Format("2006-01-02")
			}
			behind := ""
			if g.State == rotation.StateCurrent {
				behind = fmt.Sprintf("%d of %d nodes", k.Behind, k.Nodes)
			}
			fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\n", k.Kind, g.Gen, g.State, g.Fingerprint, g.CreatedAt.UTC().Format(time.RFC3339), exp, behind)
		}
	}
	w.Flush()
	var behind []string
	for _, k := range st {
		if k.Behind > 0 {
			behind = append(behind, fmt.Sprintf("%s (%d)", k.Kind, k.Behind))
		}
	}
	if len(behind) > 0 {
		fmt.Fprintf(a.env.Stdout, "\nnodes behind: %s; they catch up at their next renewal\n", strings.Join(behind, ", "))
	}
}

// currentBundle returns the keys in force: the database's with --config or
// --dev, or with --dir when the database sits beside the directory (see
// besideDir), else the PKI directory's (dir, with $BETTER_COMPUTE_SECRET).
func (a *app) currentBundle(ctx context.Context, d deployment, dir string) (*ca.Bundle, error) {
	if d.config == "" && d.dev == "" {
		// A database beside the directory knows the keys in force.
		if beside, ok := besideDir(a.pkiDir(dir)); ok {
			d = beside
		}
	}
	if d.config == "" && d.dev == "" && d.sqlite == "" {
		sec, err := a.secret()
		if err != nil {
			return nil, err
		}
		return ca.Load(a.pkiDir(dir), sec)
	}
	db, pkiDir, sec, err := a.openDeployment(ctx, d, true)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	base, err := ca.Load(pkiDir, sec)
	if err != nil {
		return nil, err
	}
	ring, err := rotation.Open(ctx, rotation.Config{DB: db, Base: base, Secret: sec})
	if err != nil {
		return nil, err
	}
	return ring.Current(), nil
}

// pinSetKeys are bcd's config keys of each pinned kind's set.
var pinSetKeys = []struct{ kind, key, jsonKey string }{
	{ca.KindServingCA, "serving_ca_spki_pins", "servingCaPins"},
	{ca.KindJoinSigning, "join_signing_key_pins", "joinSigningKeyPins"},
	{ca.KindJoinEncryption, "join_encryption_key_pins", "joinEncryptionKeyPins"},
}

// printPinSets prints the database's pin sets: the generations in force,
// oldest first. A set of one is printed as its single-pin key, the form a
// config takes when nothing rotates.
func (a *app) printPinSets(ctx context.Context, d deployment) error {
	pub, err := a.publicKeys(ctx, d)
	if err != nil {
		return err
	}
	return a.printPublic(pub)
}

func (a *app) printPublic(pub rotation.Public) error {
	if a.wantJSON() {
		out := map[string][]string{}
		for _, k := range pinSetKeys {
			out[k.jsonKey] = pub.Sets[k.kind]
		}
		return a.printJSON(out)
	}
	fmt.Fprintln(a.env.Stdout, "# for /etc/bcd/config.toml")
	for _, k := range pinSetKeys {
		set := pub.Sets[k.kind]
		if len(set) == 1 {
			fmt.Fprintf(a.env.Stdout, "%s = %q\n", strings.TrimSuffix(k.key, "s"), set[0])
			continue
		}
		quoted := make([]string, len(set))
		for i, p := range set {
			quoted[i] = fmt.Sprintf("%q", p)
		}
		fmt.Fprintf(a.env.Stdout, "%s = [%s]\n", k.key, strings.Join(quoted, ", "))
	}
	return nil
}

func (a *app) pkiCAFileCmd() *cobra.Command {
	var d deployment
	var out string
	cmd := &cobra.Command{
		Use:   "ca-file --config FILE [--out FILE]",
		Short: "Write the serving CAs in force: what a gateway's api_ca_file holds",
		Long: `Print (or write atomically to --out) the PEM of every serving CA in force:
the current one and, while it rotates, the next or previous one. A gateway
verifies the API's agent listener against its api_ca_file and reloads it
when it changes, so after 'pki rotate serving-ca --phase prepare' write
this over every gateway's api_ca_file, and again after retire. Needs no
secret.`,
		Example: `  better-compute pki ca-file --config /etc/better-compute/config.toml --out /etc/better-compute/serving-ca.crt`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			pub, err := a.publicKeys(cmd.Context(), d)
			if err != nil {
				return err
			}
			var pemData []byte
			for _, c := range pub.ServingCAs {
				pemData = append(pemData, pki.CertPEM(c)...)
			}
			if out == "" {
				_, err := a.env.Stdout.Write(pemData)
				return err
			}
			if err := fsutil.WriteFileAtomic(out, pemData, 0o644); err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stderr, "wrote %d serving CA(s) to %s\n", len(pub.ServingCAs), out)
			return nil
		},
	}
	d.flags(cmd)
	cmd.Flags().StringVar(&out, "out", "", "file to write (atomically) instead of standard output")
	return cmd
}

// publicKeys reads the keys in force from the deployment's database
// (public parts only: no secret).
func (a *app) publicKeys(ctx context.Context, d deployment) (rotation.Public, error) {
	db, _, _, err := a.openDeployment(ctx, d, false)
	if err != nil {
		return rotation.Public{}, err
	}
	defer db.Close()
	return rotation.PublicKeys(ctx, db)
}
