package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/rotation"
	"github.com/better-compute/better-compute/internal/shared/fsutil"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/secret"
)

// SecretEnv holds the secret that encrypts the PKI's private keys.
const SecretEnv = "BETTER_COMPUTE_SECRET"

// DefaultPKIDir is where pki init writes the bundle.
const DefaultPKIDir = "/var/lib/better-compute/pki"

func (a *app) secret() ([]byte, error) {
	s := a.env.Getenv(SecretEnv)
	if s == "" {
		return nil, errs.New(errs.InvalidConfig, "%s is not set: it encrypts the PKI's private keys; set it (and keep it safe) first", SecretEnv)
	}
	return []byte(s), nil
}

func (a *app) pkiDir(flag string) string {
	if flag != "" {
		return flag
	}
	if d := a.env.Getenv("BETTER_COMPUTE_PKI_DIR"); d != "" {
		return d
	}
	return DefaultPKIDir
}

func (a *app) pkiCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "pki", Short: "The machine PKI: CAs, JoinService keys, gateway certificates, pins"}
	cmd.AddCommand(a.pkiInitCmdCmd(), a.pkiIssueCmd(), a.pkiPinsCmd(), a.pkiGenCmd(), a.pkiRotateCmd(), a.pkiStatusCmd(), a.pkiCAFileCmd())
	return cmd
}

func (a *app) pkiInitCmdCmd() *cobra.Command {
	var dir, td string
	initCmd := &cobra.Command{
		Use:   "init --trust-domain D [--dir DIR]",
		Short: "Write a new PKI bundle (never overwrites one)",
		Long: `Write the machine PKI: the node CA, the gateway serving CA, the
command-signing key, and the JoinService signing and encryption keys. Private
keys are encrypted with a key derived (scrypt) from $BETTER_COMPUTE_SECRET;
the command refuses without it, refuses a secret estimated below 128 bits of
entropy (make one with 'better-compute pki generate-secret'), and never
overwrites an existing bundle.

Point the server at the directory with [pki] dir = "…" in its config.`,
		Example: `  export BETTER_COMPUTE_SECRET="$(better-compute pki generate-secret)"
  better-compute pki init --trust-domain compute.example.com`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("trust-domain", td); err != nil {
				return err
			}
			sec, err := a.secret()
			if err != nil {
				return err
			}
			d := a.pkiDir(dir)
			b, err := ca.Init(d, td, sec, time.Now())
			if err != nil {
				return err
			}
			pins, err := b.Pins()
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(map[string]any{"dir": d, "trustDomain": b.TrustDomain, "pins": pinsJSON(pins)})
			}
			fmt.Fprintf(a.env.Stdout, "wrote the PKI for trust domain %s to %s\n\n", b.TrustDomain, d)
			a.printPins(pins)
			return nil
		},
	}
	initCmd.Flags().StringVar(&dir, "dir", "", "bundle directory (default $BETTER_COMPUTE_PKI_DIR or "+DefaultPKIDir+")")
	initCmd.Flags().StringVar(&td, "trust-domain", "", "SPIFFE trust domain, e.g. compute.example.com")
	return initCmd
}

func (a *app) pkiIssueCmd() *cobra.Command {
	var gDir, certOut, keyOut string
	var sans []string
	var ttl time.Duration
	var d deployment
	issue := &cobra.Command{
		Use:   "issue-gateway --san HOST [--san HOST...]",
		Short: "Issue a gateway serving certificate from the serving CA",
		Long: `Issue a gateway (or agent-listener) certificate from the serving CA. With
--config (or --dev) it is issued by the serving CA that is current in the
database, the one to use once a rotated serving CA is activated; with
--dir alone, by the serving CA in force in the database beside the
directory (DIR/../bc.db) when there is one, else by the PKI directory's
own serving CA (the first generation). Gateways and the API
load a certificate written over their files without a restart.`,
		Example: "  better-compute pki issue-gateway --san gw.eu.example.com --config /etc/better-compute/config.toml",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(sans) == 0 {
				return errs.Invalid("--san", "at least one host name or IP is required")
			}
			for _, p := range []string{certOut, keyOut} {
				if _, err := os.Lstat(p); err == nil {
					return errs.New(errs.AlreadyExists, "%s exists; choose another --cert-out/--key-out", p)
				} else if !errors.Is(err, fs.ErrNotExist) {
					return err
				}
			}
			b, err := a.currentBundle(cmd.Context(), d, gDir)
			if err != nil {
				return err
			}
			certPEM, keyPEM, err := ca.IssueGateway(b, sans, time.Now(), ttl)
			if err != nil {
				return err
			}
			if err := writeNew(keyOut, keyPEM, 0o600); err != nil {
				return err
			}
			if err := writeNew(certOut, certPEM, 0o644); err != nil {
				os.Remove(keyOut)
				return err
			}
			if a.wantJSON() {
				return a.printJSON(map[string]any{"certFile": certOut, "keyFile": keyOut, "sans": sans, "ttlSeconds": int64(ttl / time.Second)})
			}
			fmt.Fprintf(a.env.Stdout, "wrote %s and %s (0600) for %v, valid %s\n", certOut, keyOut, sans, ttl)
			return nil
		},
	}
	issue.Flags().StringVar(&gDir, "dir", "", "bundle directory")
	d.flags(issue)
	issue.Flags().StringArrayVar(&sans, "san", nil, "DNS name or IP the gateway serves (repeatable)")
	issue.Flags().StringVar(&certOut, "cert-out", "gateway.crt", "certificate chain file to create")
	issue.Flags().StringVar(&keyOut, "key-out", "gateway.key", "private key file to create (0600)")
	issue.Flags().DurationVar(&ttl, "ttl", 365*24*time.Hour, "certificate lifetime")
	return issue
}

func (a *app) pkiPinsCmd() *cobra.Command {
	var pDir string
	var d deployment
	pins := &cobra.Command{
		Use:   "pins [--dir DIR | --config FILE]",
		Short: "Print the pins a bcd config needs",
		Long: `Print the pins (sha256/<base64 of the SPKI's SHA-256>) of the gateway serving
CA and the JoinService signing and encryption keys. Pins are public: they are
read from the bundle's certificates and join-encryption.jwk, without
$BETTER_COMPUTE_SECRET.

With --config (or --dev) they are read from the database instead, as pin
sets: every generation in force (current, and the next or previous one
while a key rotates), oldest first, in the form bcd's config.toml takes.
With --dir, when the directory's database sits beside it (DIR/../bc.db, as
in dev and the default install) the pins are that database's too: the
PKI directory keeps only the first generation of each key.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if d.config != "" || d.dev != "" {
				return a.printPinSets(cmd.Context(), d)
			}
			pub, err := a.dirKeys(cmd.Context(), a.pkiDir(pDir), "pki pins")
			if err != nil {
				return err
			}
			if pub != nil {
				return a.printDirPins(*pub)
			}
			b, err := ca.LoadPublic(a.pkiDir(pDir))
			if err != nil {
				return err
			}
			p, err := b.Pins()
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(pinsJSON(p))
			}
			a.printPins(p)
			return nil
		},
	}
	pins.Flags().StringVar(&pDir, "dir", "", "bundle directory")
	d.flags(pins)
	return pins
}

func (a *app) pkiGenCmd() *cobra.Command {
	gen := &cobra.Command{
		Use:   "generate-secret",
		Short: "Print a new BETTER_COMPUTE_SECRET (256 random bits)",
		Long: `Print a new secret for BETTER_COMPUTE_SECRET: 256 random bits, base64url
(43 characters), on one line. pki init refuses a secret estimated below 128
bits of entropy; a generated one always passes. Keep it in your secret
manager: it is the only way to decrypt the bundle's keys.`,
		Example: `  export BETTER_COMPUTE_SECRET="$(better-compute pki generate-secret)"`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			s := secret.GenerateStrong()
			if a.wantJSON() {
				return a.printJSON(map[string]string{"secret": s})
			}
			_, err := fmt.Fprintln(a.env.Stdout, s)
			return err
		},
	}
	return gen
}

func pinsJSON(p pki.Pins) map[string]string {
	return map[string]string{"servingCaPin": p.ServingCA, "joinSigningKeyPin": p.JoinSigning, "joinEncryptionKeyPin": p.JoinEncryption}
}

// printDirPins prints the database's keys for a --dir form: as before
// (one pin each) while nothing rotates, as pin sets while something does.
func (a *app) printDirPins(pub rotation.Public) error {
	for _, k := range pinSetKeys {
		if len(pub.Sets[k.kind]) != 1 {
			return a.printPublic(pub)
		}
	}
	if a.wantJSON() {
		return a.printJSON(pinsJSON(pub.Pins))
	}
	a.printPins(pub.Pins)
	return nil
}

func (a *app) printPins(p pki.Pins) {
	fmt.Fprintf(a.env.Stdout, "# for /etc/bcd/config.toml\nserving_ca_spki_pin = %q\njoin_signing_key_pin = %q\njoin_encryption_key_pin = %q\n", p.ServingCA, p.JoinSigning, p.JoinEncryption)
}

// writeNew creates path with data, never overwriting (ALREADY_EXISTS).
func writeNew(path string, data []byte, mode os.FileMode) error {
	if err := fsutil.WriteNew(path, data, mode); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return errs.New(errs.AlreadyExists, "%s exists; it is never overwritten", path)
		}
		return err
	}
	return nil
}
