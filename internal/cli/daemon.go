package cli

import (
	"context"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/installscript"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// daemonCmd is the `daemon` group: what operators need to put bcd on
// machines (R3.5).
func (a *app) daemonCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "daemon", Short: "Install bcd, the node daemon, on machines"}
	var p installscript.Params
	var sums []string
	var dir, caFile string
	var d deployment
	script := &cobra.Command{
		Use:   "install-script --pool P --site S --gateway-url URL --base-url URL --bcd-version V --sha256 amd64=HEX,arm64=HEX",
		Short: "Print a POSIX sh script that installs bcd and joins the machine",
		Long: `Print the install script for brownfield servers (R3.5, R11.5). It embeds
the gateway, the site, the three pins and the JoinService encryption key from
the PKI bundle (its public files only, like pki pins: no
$BETTER_COMPUTE_SECRET needed), and the SHA-256 of each bcd build. It holds
no secret.

On the machine, as root, the script reads the join token from BCD_JOIN_TOKEN
or standard input (never an argument), downloads
{base-url}{base-path}/downloads/bcd/{version}/linux-{arch}, checks its
SHA-256, installs /usr/local/bin/bcd, /etc/bcd/config.toml,
/etc/bcd/join-encryption.jwk and bcd.service, runs bcd join with the token on
standard input, and enables the service. Without a token on a host that
already has /etc/bcd/config.toml it upgrades bcd in place.

--download-ca-file embeds CA certificates the script trusts for the download
instead of the system's: for a control plane with a private CA, such as
better-compute dev (bc-dev/ca.pem). The download is still checked against
its SHA-256; the script never falls back to plain http.

With --config (or --dev) the pins and the encryption key are the database's,
the keys in force after a rotation: use it once any key has rotated (the
PKI directory only holds the first generation). --pki-dir reads them from
the database beside the directory (DIR/../bc.db, dev's layout and the
default install's) when there is one, and otherwise says that it could not.`,
		Example: `  better-compute daemon install-script --pool $POOL --site $SITE \
    --gateway-url https://gw.eu.example.com --base-url https://compute.example.com \
    --bcd-version 0.1.0 --sha256 amd64=<hex>,arm64=<hex> > install-bcd.sh
  sudo sh install-bcd.sh < join-token`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, f := range []struct{ name, val string }{
				{"pool", p.Pool}, {"site", p.Site}, {"gateway-url", p.GatewayURL},
				{"base-url", p.BaseURL}, {"bcd-version", p.Version},
			} {
				if err := required(f.name, f.val); err != nil {
					return err
				}
			}
			if len(sums) == 0 {
				return errs.Invalid("--sha256", "required: amd64=<64 hex>,arm64=<64 hex>")
			}
			var err error
			if p.SHA256, err = installscript.ParseSHA256(sums); err != nil {
				return err
			}
			if caFile != "" {
				if p.DownloadCA, err = readSmallFile("--download-ca-file", caFile); err != nil {
					return err
				}
			}
			// A typo is reported before the bundle is read.
			if err := p.ValidateFlags(); err != nil {
				return err
			}
			if err := a.installKeys(cmd.Context(), &p, d, dir); err != nil {
				return err
			}
			out, err := installscript.Generate(p)
			if err != nil {
				return err
			}
			_, err = a.env.Stdout.Write(out)
			return err
		},
	}
	f := script.Flags()
	f.StringVar(&p.Pool, "pool", "", "pool the machines join, pool_… (the join token's pool)")
	f.StringVar(&p.Site, "site", "", "site of that pool, site_… (config.toml's site)")
	f.StringVar(&p.GatewayURL, "gateway-url", "", "regional gateway bcd dials, https://…")
	f.StringVar(&p.GatewayServerName, "gateway-server-name", "", "TLS server name of the gateway when it differs from the URL's host")
	f.StringVar(&p.BaseURL, "base-url", "", "control plane that serves the bcd downloads, https://host[:port]")
	f.StringVar(&p.BasePath, "base-path", installscript.DefaultBasePath, "the API's base path")
	f.StringVar(&p.Version, "bcd-version", "", "bcd version to install, like 0.1.0")
	f.StringSliceVar(&sums, "sha256", nil, "SHA-256 of each build: amd64=<hex>,arm64=<hex>")
	f.StringVar(&dir, "pki-dir", "", "PKI bundle directory (default $BETTER_COMPUTE_PKI_DIR or "+DefaultPKIDir+")")
	d.flags(script)
	f.StringVar(&caFile, "download-ca-file", "", "PEM CA certificates the script trusts for the download (a private CA, like better-compute dev's bc-dev/ca.pem)")
	cmd.AddCommand(script)
	return cmd
}

// readSmallFile reads a file a flag names, at most 1 MiB.
func readSmallFile(flag, path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, errs.Invalid(flag, "%v", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, 1<<20+1))
	if err != nil {
		return nil, errs.Invalid(flag, "%v", err)
	}
	if len(data) > 1<<20 {
		return nil, errs.Invalid(flag, "%s is larger than 1 MiB", path)
	}
	return data, nil
}

// installKeys fills p's pins and encryption key: the database's keys in
// force with --config or --dev, else the PKI directory's public files.
func (a *app) installKeys(ctx context.Context, p *installscript.Params, d deployment, dir string) error {
	if d.config != "" || d.dev != "" {
		pub, err := a.publicKeys(ctx, d)
		if err != nil {
			return err
		}
		p.Pins, p.EncryptionKey = pub.Pins, pub.EncryptionKey
		return nil
	}
	pub, err := a.dirKeys(ctx, a.pkiDir(dir), "daemon install-script")
	if err != nil {
		return err
	}
	if pub != nil {
		p.Pins, p.EncryptionKey = pub.Pins, pub.EncryptionKey
		return nil
	}
	b, err := ca.LoadPublic(a.pkiDir(dir))
	if err != nil {
		return err
	}
	if p.Pins, err = b.Pins(); err != nil {
		return err
	}
	p.EncryptionKey = b.JoinEncryption
	return nil
}
