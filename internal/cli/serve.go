package cli

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/shared/wire"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fakemachine"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// logger builds the process's log from its config file's [log] section,
// with --log-level and --log-format, when given, taking precedence.
func (a *app) logger(c telemetry.LogConfig, cmd *cobra.Command) (*slog.Logger, error) {
	if f := cmd.Flags().Lookup("log-level"); f != nil && (f.Changed || c.Level == "") {
		c.Level = f.Value.String()
	}
	if f := cmd.Flags().Lookup("log-format"); f != nil && (f.Changed || c.Format == "") {
		c.Format = f.Value.String()
	}
	return telemetry.NewLogger(a.env.Stderr, c)
}

// logFlags adds --log-level and --log-format.
func logFlags(cmd *cobra.Command) {
	cmd.Flags().String("log-level", "info", "debug, info, warn or error (overrides [log] level)")
	cmd.Flags().String("log-format", telemetry.FormatText, "text or json (overrides [log] format)")
}

func signalContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
}

func (a *app) serveCmd() *cobra.Command {
	var path string
	var printConfig bool
	cmd := &cobra.Command{
		Use:   "serve --config FILE",
		Short: "Run the control plane API",
		Long: `Run the API from a TOML config (unknown keys are errors). The PKI bundle's
keys are decrypted with $BETTER_COMPUTE_SECRET. SIGINT/SIGTERM shut down
gracefully. --print-config prints a commented example.

One process when one machine is enough: with [gateway] listen, serve also
runs the gateway daemons connect to, and the gateway calls the API in
memory (no [agent] listener, loopback hop or second TLS layer):

  [gateway]
  url = "https://gw.example.com:443"        # published in the well-known document
  listen = ":443"
  cert_file = "/etc/better-compute/gateway.crt"   # better-compute pki issue-gateway
  key_file = "/etc/better-compute/gateway.key"
  # the limits of better-compute gateway's config (max_sessions, ...) apply;
  # api_url and api_ca_file do not
  [gateway.metrics]
  listen = "127.0.0.1:9465"                 # the gateway's /metrics, /livez, /readyz

For regions, run better-compute gateway near the machines instead, relaying
to the [agent] listener (docs/operations/configure.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if printConfig {
				fmt.Fprint(a.env.Stdout, server.Example)
				return nil
			}
			if err := required("config", path); err != nil {
				return err
			}
			cfg, err := server.LoadConfig(path)
			if err != nil {
				return err
			}
			log, err := a.logger(cfg.Log, cmd)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext(cmd.Context())
			defer cancel()
			return server.Run(ctx, cfg, server.Options{Log: log, Secret: []byte(a.env.Getenv(SecretEnv))})
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "TOML config file")
	logFlags(cmd)
	cmd.Flags().BoolVar(&printConfig, "print-config", false, "print an example config and exit")
	return cmd
}

// devState is what `dev` bootstraps and writes to dev.env.
type devState struct {
	key, tenant, site, pool string
}

// Bounds of dev --cert-ttl, JoinService's own (R7.1).
const (
	devMinCertTTL = time.Minute
	devMaxCertTTL = 24 * time.Hour
)

func (a *app) devCmd() *cobra.Command {
	var o devOptions
	cmd := &cobra.Command{
		Use:   "dev [--data-dir DIR]",
		Short: "Run a complete local control plane on an embedded database",
		Long: `Run the API on an embedded SQLite database in a data directory, with
everything bootstrapped: the machine PKI, a root tenant, an admin API key, a
site and a bcd pool. It writes DIR/dev.env; after

    source DIR/dev.env

the CLI examples run as written (BETTER_COMPUTE_URL, BETTER_COMPUTE_API_KEY,
BETTER_COMPUTE_CA_FILE, TENANT, SITE, POOL). The API serves https on
loopback with a certificate from the dev PKI's serving CA, written to
DIR/ca.pem. It also runs a gateway and writes DIR/bcd/config.toml, so that

    bcd fake-machine --out ./fake-sys --serial SN-7701
    bcd join --config DIR/bcd/config.toml --sysfs-root ./fake-sys < join-token

joins a made-up machine to it (docs/joining.md). Restarting on the same
directory keeps everything. While it runs, dev holds DIR/dev.lock: a second
dev on the same directory refuses and names the first (its pid and
addresses). dev refuses a non-empty directory it did not make rather than
write over its files.

It serves a bcd build under {url}/api/compute/downloads/bcd/{version}/linux-{arch}
for the install script (better-compute daemon install-script
--download-ca-file DIR/ca.pem): --bcd-binary, else the bcd beside this
better-compute, else one built with go build from the working directory.

--config FILE applies a server config (serve's TOML, see serve
--print-config) over dev's own, so any option can be tried here: [join]
svid_form, [limits], [export], [tracing], …. Options dev decides itself
(listen, [tls], [store], [pki], [agent], [downloads], the gateway's address
and certificate) are refused.

--cert-ttl shortens node certificates (60s to 24h; default 24h) so that
renewal and the x509pop re-join of an expired certificate can be watched in
minutes.

--tpm-ca-file and --tpm-enrollment run the tpm attestor for the dev pool
(docs/tpm.md): EKs whose certificate chains to a --tpm-ca-file (swtpm_setup's
local CA, say) join with no token, and with --tpm-enrollment an unknown EK
becomes a join request to approve; with --tpm-allow-reclaim the same TPM takes
its node back after bcd join --reset. --tpm-simulator ADDR puts that swtpm
command port into DIR/bcd/config.toml ([tpm] mode = "required").

For development only: the secret that encrypts the PKI's keys is kept in
DIR/dev-secret, and an exported $BETTER_COMPUTE_SECRET is not used for it
(dev says so). A directory without DIR/dev-secret (restored from a backup)
is opened with $BETTER_COMPUTE_SECRET.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.Flags().Changed("cert-ttl") {
				if o.certTTL < devMinCertTTL || o.certTTL > devMaxCertTTL || o.certTTL%time.Second != 0 {
					return errs.Invalid("--cert-ttl", "want a duration from 60s to 24h in whole seconds, like 2m")
				}
			}
			// A bad --config fails before dev writes anything.
			if _, err := devOverlay(server.Config{Store: store.Config{Path: "bc.db"}}, o.config); err != nil {
				return err
			}
			log, err := a.logger(telemetry.LogConfig{}, cmd)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext(cmd.Context())
			defer cancel()
			return a.runDev(ctx, o, log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.dir, "data-dir", "bc-dev", "data directory (created 0700)")
	f.StringVar(&o.listen, "listen", "127.0.0.1:8080", "API address (https on loopback; :0 picks a port)")
	f.StringVar(&o.gwListen, "gateway-listen", "127.0.0.1:8443", "gateway address daemons join through (TLS; :0 picks a port)")
	f.StringVar(&o.metricsListen, "metrics-listen", "", "serve the API's /metrics here, e.g. 127.0.0.1:9090 (default: none)")
	f.StringVar(&o.gwMetricsListen, "gateway-metrics-listen", "", "serve the gateway's /metrics, /livez and /readyz here, e.g. 127.0.0.1:9465 (default: none)")
	f.StringVar(&o.td, "trust-domain", "dev.better-compute.internal", "SPIFFE trust domain of a new PKI")
	f.DurationVar(&o.certTTL, "cert-ttl", 0, "node certificate lifetime, 60s to 24h (default 24h); short ones show renewal and x509pop in minutes")
	f.StringVar(&o.bcdBinary, "bcd-binary", "", "the linux bcd the downloads path serves (default: the bcd beside better-compute, else go build)")
	f.StringArrayVar(&o.tpmCAFiles, "tpm-ca-file", nil, "run the tpm attestor for the dev pool, trusting EKs certified by this manufacturer CA (PEM; repeatable)")
	f.BoolVar(&o.tpmEnrollment, "tpm-enrollment", false, "run the tpm attestor for the dev pool; an unknown EK becomes a join request")
	f.BoolVar(&o.tpmAllowReclaim, "tpm-allow-reclaim", false, "with --tpm-ca-file: the same TPM takes its node back after bcd join --reset (the pool's allow_reclaim)")
	f.StringVar(&o.config, "config", "", "a server config (serve's TOML) whose options apply over dev's own, e.g. [join] svid_form; dev keeps its data, keys and listeners")
	f.StringVar(&o.tpmSimulator, "tpm-simulator", "", "swtpm command port (host:port) written into the dev bcd config's [tpm]")
	logFlags(cmd)
	return cmd
}

type devOptions struct {
	dir, listen, gwListen, td string
	// metricsListen and gwMetricsListen serve the API's and the gateway's
	// /metrics (and the gateway's /livez, /readyz); empty: none.
	metricsListen, gwMetricsListen string
	certTTL                        time.Duration
	bcdBinary                      string
	// The tpm attestor for the dev pool, and the swtpm of dev's bcd.
	tpmCAFiles      []string
	tpmEnrollment   bool
	tpmAllowReclaim bool
	tpmSimulator    string
	// config is a server config applied over dev's own (devOverlay).
	config string
	// buildBCD builds bcd when none is found; nil means goBuildBCD.
	buildBCD func(ctx context.Context, out, arch string) error
}

// devRootTenant is the root tenant's name in dev.
const devRootTenant = "root"

// devCAFile is the CA that verifies dev's API (and gateway) certificates:
// the dev PKI's serving CA.
const devCAFile = "ca.pem"

func (a *app) runDev(ctx context.Context, o devOptions, log *slog.Logger) error {
	dir, err := filepath.Abs(o.dir)
	if err != nil {
		return err
	}
	if err := checkDevDir(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	lock, err := lockDevDir(dir)
	if err != nil {
		return err
	}
	defer lock.release()
	lock.note("pid %d", os.Getpid())
	sec, note, err := devSecret(dir, a.env.Getenv(SecretEnv))
	if err != nil {
		return err
	}
	if note != "" {
		log.Info(note)
	}
	pkiDir := filepath.Join(dir, "pki")
	bundle, caFile, err := devPKI(dir, pkiDir, o.td, sec, log)
	if err != nil {
		return err
	}

	// The bcd the install script downloads. Its absence only costs that
	// step of the walkthrough.
	build := o.buildBCD
	if build == nil {
		build = goBuildBCD
	}
	downloadsDir := filepath.Join(dir, "downloads")
	self, _ := os.Executable()
	dl, err := devBCD(ctx, log, downloadsDir, o.bcdBinary, self, build)
	if err != nil {
		if o.bcdBinary != "" {
			return err
		}
		log.Warn("the install script cannot be tried: no bcd to serve", "err", err)
	} else {
		log.Info("serving bcd for the install script", "version", dl.Version, "arch", dl.Arch, "sha256", dl.SHA256, "from", dl.Source)
	}

	// The gateway's listener first: its address goes into the well-known
	// document and the bcd config, and --gateway-listen may pick a port.
	gwLn, err := net.Listen("tcp", o.gwListen)
	if err != nil {
		if err := inUse(err, "--gateway-listen", o.gwListen); errs.CodeOf(err) == errs.Conflict {
			return err
		}
		return errs.Wrap(err, errs.InvalidConfig, "gateway listen %s: %v", o.gwListen, err)
	}
	defer gwLn.Close()
	gwURL := "https://" + gwLn.Addr().String()
	cfg := server.Config{
		Listen: o.listen, RootTenant: devRootTenant,
		TLS:   server.TLSConfig{CertFile: filepath.Join(dir, "api.crt"), KeyFile: filepath.Join(dir, "api.key")},
		Store: store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:   server.PKIConfig{Dir: pkiDir},
		// The gateway runs in this process and calls the API's agent
		// handler in memory: no agent listener (gateway.Options.LocalAPI).
		Gateway: server.GatewayConfig{URL: gwURL, Config: gateway.Config{
			Listen: gwLn.Addr().String(), CertFile: filepath.Join(dir, "gateway.crt"), KeyFile: filepath.Join(dir, "gateway.key"),
			Metrics: gateway.MetricsConfig{Listen: o.gwMetricsListen},
		}},
		// dev enables every attestor that is built, so every flow of the docs can be tried.
		Join:      server.JoinConfig{Attestors: []string{wire.AttestorJoinToken, wire.AttestorX509Pop, wire.AttestorDiscovery}, CertTTLSeconds: int(o.certTTL / time.Second)},
		Downloads: server.DownloadsConfig{Dir: downloadsDir},
		Metrics:   server.MetricsConfig{Listen: o.metricsListen},
	}
	if cfg, err = devOverlay(cfg, o.config); err != nil {
		return err
	}
	envPath := filepath.Join(dir, "dev.env")
	// The tenant, site and pool are made before the API is built, so the
	// tpm attestor's configuration can name the dev pool.
	st, err := devBootstrapStore(ctx, cfg.Store, envPath)
	if err != nil {
		return err
	}
	if len(o.tpmCAFiles) > 0 || o.tpmEnrollment {
		cfg.Join.Attestors = append(cfg.Join.Attestors, wire.AttestorTPM)
		cfg.Join.TPM.Pools = []server.TPMPoolConfig{{Pool: st.pool, ManufacturerCAFiles: o.tpmCAFiles, Enrollment: o.tpmEnrollment, AllowReclaim: o.tpmAllowReclaim}}
	}
	ready := devReady{a: a, log: log, o: o, dir: dir, envPath: envPath, caFile: caFile, gwURL: gwURL, st: st, bundle: bundle, dl: dl, lock: lock}
	err = server.Run(ctx, cfg, server.Options{
		Log:    log,
		Secret: sec,
		Setup: func(ctx context.Context, s *api.Server, db *store.DB) error {
			_, err := mintDevSiteTokens(ctx, s, db, dir, st)
			return err
		},
		GatewayListener: gwLn,
		Ready:           ready.print,
	})
	return inUse(err, "--listen", o.listen)
}

// devPKI makes (once) and loads dev's machine PKI, and the loopback
// serving certificates of the gateway and the API; it writes the CA that
// verifies them (ca.pem) and returns its path. (Data directories made
// before the gateway ran in memory also hold an unused agent.crt.)
func devPKI(dir, pkiDir, td string, sec []byte, log *slog.Logger) (*ca.Bundle, string, error) {
	if _, err := os.Stat(filepath.Join(pkiDir, ca.FileManifest)); errors.Is(err, fs.ErrNotExist) {
		if _, err := ca.Init(pkiDir, td, sec, time.Now()); err != nil {
			return nil, "", err
		}
		log.Info("wrote the machine PKI", "dir", pkiDir, "trust_domain", td)
	}
	bundle, err := ca.Load(pkiDir, sec)
	if err != nil {
		return nil, "", err
	}
	for _, name := range []string{"gateway", "api"} {
		crt, key := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
		if _, err := os.Stat(crt); err == nil {
			continue
		}
		certPEM, keyPEM, err := ca.IssueGateway(bundle, []string{"127.0.0.1", "localhost", "::1"}, time.Now(), 365*24*time.Hour)
		if err != nil {
			return nil, "", err
		}
		_ = os.Remove(key)
		if err := writeNew(key, keyPEM, 0o600); err != nil {
			return nil, "", err
		}
		if err := writeNew(crt, certPEM, 0o644); err != nil {
			return nil, "", err
		}
	}
	caFile := filepath.Join(dir, devCAFile)
	if err := fsutil.WriteFileAtomic(caFile, pki.CertPEM(bundle.ServingCA), 0o644); err != nil {
		return nil, "", fmt.Errorf("write %s: %w", caFile, err)
	}
	return bundle, caFile, nil
}

// devReady writes what a person needs once the API listens (dev.env, the
// bcd configs) and prints the banner.
type devReady struct {
	a                           *app
	log                         *slog.Logger
	o                           devOptions
	dir, envPath, caFile, gwURL string
	st                          devState
	bundle                      *ca.Bundle
	dl                          *devDownload
	lock                        *devLock
}

func (r devReady) print(addr string) {
	url := "https://" + addr
	r.lock.note("pid %d, API %s, gateway %s", os.Getpid(), url, r.gwURL)
	if err := writeDevEnv(r.envPath, url, r.caFile, r.st); err != nil {
		r.log.Error("write dev.env", "err", err)
		return
	}
	bcdConf, err := writeDevBCD(r.dir, r.gwURL, r.st.site, r.bundle, r.o.tpmSimulator)
	if err != nil {
		r.log.Error("write the bcd config", "err", err)
		return
	}
	siteConf, ramdiskConf, err := writeDevSiteConfigs(r.dir, r.gwURL, r.st.site, r.bundle)
	if err != nil {
		r.log.Error("write the site agent's and the booted machine's bcd configs", "err", err)
		return
	}
	ttl := r.o.certTTL
	if ttl == 0 {
		ttl = devMaxCertTTL
	}
	fmt.Fprint(r.a.env.Stdout, devBanner(devBannerData{
		URL: url, Dir: r.dir, GatewayURL: r.gwURL, EnvPath: r.envPath, BCDConf: bcdConf, CAFile: r.caFile, CertTTL: ttl,
		Download: r.dl,
	}))
	fmt.Fprint(r.a.env.Stdout, devDiscoveryBanner(r.dir, siteConf, ramdiskConf))
}

type devBannerData struct {
	URL, Dir, GatewayURL, EnvPath, BCDConf, CAFile string
	CertTTL                                        time.Duration
	Download                                       *devDownload
}

// devBanner is what dev prints once it serves: every flow of the README, as
// commands to paste.
func devBanner(d devBannerData) string {
	var b strings.Builder
	fmt.Fprintf(&b, `
better-compute dev is running at %s%s (data in %s)
gateway for daemons: %s; node certificates last %s (--cert-ttl)
web console: %s%s/console/ (sign in with $BETTER_COMPUTE_API_KEY)

  source %s
  better-compute join-tokens create --tenant $TENANT --pool $POOL --ttl 1h \
    --expect-serial SN-7701 --key adopt-rack-b7-u12 --out ./join-token
  better-compute join-tokens list --tenant $TENANT --pool $POOL
  better-compute events list --tenant $TENANT

Join a fake machine (bcd reads its serials and MACs from ./fake-sys):
  bcd fake-machine --out ./fake-sys --serial SN-7701
  bcd join --config %s --sysfs-root ./fake-sys < ./join-token
  bcd run --config %s          # the session, commands and renewals
  better-compute nodes list --tenant $TENANT
`, d.URL, wire.DefaultBasePath, d.Dir, d.GatewayURL, d.CertTTL, d.URL, wire.DefaultBasePath, d.EnvPath, d.BCDConf, d.BCDConf)
	if d.Download != nil {
		// install-script reads only the bundle's public files: no secret.
		fmt.Fprintf(&b, `
Install with the install script (bcd %s for linux-%s is served; BCD_ROOT keeps it out of /):
  better-compute daemon install-script --pki-dir %s \
    --pool $POOL --site $SITE --gateway-url %s --base-url %s \
    --bcd-version %s --sha256 %s=%s --download-ca-file %s > install-bcd.sh
  better-compute join-tokens create --tenant $TENANT --pool $POOL --ttl 1h --out ./token-2
  bcd fake-machine --out ./fake-sys-2 --serial SN-7702
  BCD_ROOT=$PWD/host-2 BCD_SYSFS_ROOT=$PWD/fake-sys-2 sh install-bcd.sh < ./token-2
`, d.Download.Version, d.Download.Arch, filepath.Join(d.Dir, "pki"), d.GatewayURL, d.URL,
			d.Download.Version, d.Download.Arch, d.Download.SHA256, d.CAFile)
	}
	b.WriteString("\nStop with Ctrl-C; starting again on the same --data-dir keeps everything.\n")
	return b.String()
}

// writeDevBCD writes DIR/bcd/config.toml and join-encryption.jwk for a
// daemon on this machine joining the dev control plane; with an swtpm
// address, its node keys are made in that TPM (tpm.mode required).
func writeDevBCD(dir, gwURL, site string, b *ca.Bundle, tpmSimulator string) (string, error) {
	var tpm *bcdconfig.TPM
	if tpmSimulator != "" {
		tpm = &bcdconfig.TPM{Mode: bcdconfig.TPMRequired, Simulator: tpmSimulator}
	}
	return writeDevBCDAs(dir, "bcd", gwURL, site, b, nil, tpm)
}

// writeDevBCDAs writes DIR/<name>/config.toml (data in DIR/<name>/data)
// and its join key; with a fake machine, its sysfs tree goes to
// DIR/<name>/sys and the config reads its claims from there.
func writeDevBCDAs(dir, name, gwURL, site string, b *ca.Bundle, fake *fakemachine.Machine, tpm *bcdconfig.TPM) (string, error) {
	pins, err := b.Pins()
	if err != nil {
		return "", err
	}
	bdir := filepath.Join(dir, name)
	if err := os.MkdirAll(bdir, 0o755); err != nil {
		return "", err
	}
	c := &bcdconfig.Config{
		GatewayURL: gwURL, Site: site, ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption,
		DataDir: filepath.Join(bdir, "data"),
	}
	if fake != nil {
		c.SysfsRoot = filepath.Join(bdir, "sys")
		if err := fakemachine.Write(c.SysfsRoot, "", *fake); err != nil {
			return "", err
		}
	}
	if tpm != nil {
		c.TPM = *tpm
	}
	c.ApplyDefaults()
	path := filepath.Join(bdir, "config.toml")
	if err := c.Write(path); err != nil {
		return "", err
	}
	if err := bcdconfig.WriteEncryptionKey(bdir, pins.JoinEncryption, &b.JoinEncryptionKey.PublicKey); err != nil {
		return "", err
	}
	return path, nil
}

// devSecret returns the secret of dev's PKI and, when
// $BETTER_COMPUTE_SECRET (env) is set but not used, a note saying so. dev
// keeps its own secret in DIR/dev-secret: an exported production secret
// must not decide which key a development directory is encrypted under
// (it made dev fail with "cannot decrypt"). An existing PKI is opened by
// whichever of DIR/dev-secret and env opens it (a directory restored from
// a backup, or whose secret was rotated, has only env); a new one is made
// under DIR/dev-secret.
func devSecret(dir, env string) (sec []byte, note string, err error) {
	p := filepath.Join(dir, "dev-secret")
	own, err := os.ReadFile(p)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, "", err
	}
	own = []byte(strings.TrimSpace(string(own)))
	pkiDir := filepath.Join(dir, "pki")
	if _, err := os.Stat(filepath.Join(pkiDir, ca.FileManifest)); err == nil {
		return openDevPKI(pkiDir, p, own, env)
	}
	if len(own) == 0 {
		var r [32]byte
		_, _ = rand.Read(r[:])
		own = []byte(base64.RawURLEncoding.EncodeToString(r[:]))
		if err := writeNew(p, append(own, '\n'), 0o600); err != nil {
			return nil, "", err
		}
	}
	if env != "" && env != string(own) {
		note = fmt.Sprintf("$%s is set but not used: dev keeps its own secret in %s", SecretEnv, p)
	}
	return own, note, nil
}

// openDevPKI picks the secret that opens an existing dev PKI.
func openDevPKI(pkiDir, ownPath string, own []byte, env string) ([]byte, string, error) {
	if len(own) > 0 {
		if _, err := ca.Load(pkiDir, own); err == nil {
			note := ""
			if env != "" && env != string(own) {
				note = fmt.Sprintf("$%s is set but not used: this directory's keys are under %s", SecretEnv, ownPath)
			}
			return own, note, nil
		}
	}
	if env != "" {
		if _, err := ca.Load(pkiDir, []byte(env)); err == nil {
			return []byte(env), "", nil
		}
	}
	if len(own) == 0 && env == "" {
		return nil, "", errs.New(errs.InvalidConfig, "%s has no dev-secret (restored from a backup?): set %s to the secret its keys were encrypted under", filepath.Dir(ownPath), SecretEnv)
	}
	return nil, "", errs.New(errs.InvalidConfig, "neither %s nor $%s opens the keys in %s: set %s to the secret they were encrypted under", ownPath, SecretEnv, pkiDir, SecretEnv)
}

// readDevEnv reads the variables of an existing dev.env.
func readDevEnv(path string) map[string]string {
	out := map[string]string{}
	b, err := os.ReadFile(path)
	if err != nil {
		return out
	}
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimPrefix(strings.TrimSpace(line), "export ")
		if k, v, ok := strings.Cut(line, "="); ok && !strings.HasPrefix(k, "#") {
			out[k] = strings.Trim(v, `"'`)
		}
	}
	return out
}

// devBootstrapStore opens the store, makes the root tenant and runs
// devBootstrap, then closes it again.
func devBootstrapStore(ctx context.Context, c store.Config, envPath string) (devState, error) {
	db, err := store.Open(ctx, c, slog.New(slog.DiscardHandler))
	if err != nil {
		return devState{}, err
	}
	defer db.Close()
	return devBootstrap(ctx, tenancy.New(tenancy.Config{DB: db}), db, envPath)
}

func devBootstrap(ctx context.Context, ten *tenancy.Service, db *store.DB, envPath string) (devState, error) {
	var st devState
	rt, _, err := ten.Bootstrap(ctx, devRootTenant)
	if err != nil {
		return st, err
	}
	root := rt.ID
	st.tenant = root
	sys := authz.Principal{ID: "system:dev", TenantID: root, Name: "dev", Grants: authz.Admin, Root: true}
	prev := readDevEnv(envPath)
	if k := prev["BETTER_COMPUTE_API_KEY"]; k != "" {
		if p, err := authz.Authenticate(ctx, db, k); err == nil && p.TenantID == root {
			st.key = k
		}
	}
	if st.key == "" {
		// The API's own path: the key, its event and its audit row.
		if _, st.key, err = authz.New(authz.Config{DB: db}).CreateKey(ctx, sys, root, fmt.Sprintf("dev-admin-%d", time.Now().Unix()), authz.Admin, 0); err != nil {
			return st, err
		}
	}
	sites, err := ten.ListSites(ctx, sys, root, "", 200)
	if err != nil {
		return st, err
	}
	for _, x := range sites {
		if x.Name == "dev-site" && x.OwnerTenantID == root {
			st.site = x.ID
		}
	}
	if st.site == "" {
		x, err := ten.CreateSite(ctx, sys, root, "dev-site", "local")
		if err != nil {
			return st, err
		}
		st.site = x.ID
	}
	pools, err := ten.ListPools(ctx, sys, root, st.site, "", 200)
	if err != nil {
		return st, err
	}
	for _, x := range pools {
		if x.Name == "dev-pool" {
			st.pool = x.ID
		}
	}
	if st.pool == "" {
		x, err := ten.CreatePool(ctx, sys, root, st.site, "dev-pool", tenancy.AgentBCD, tenancy.Policy{})
		if err != nil {
			return st, err
		}
		st.pool = x.ID
	}
	return st, nil
}

func writeDevEnv(path, url, caFile string, st devState) error {
	body := fmt.Sprintf(`# Written by better-compute dev. Use it with: source %s
export BETTER_COMPUTE_URL=%s
export BETTER_COMPUTE_CA_FILE=%s
export BETTER_COMPUTE_API_KEY=%s
export TENANT=%s
export SITE=%s
export POOL=%s
`, path, url, caFile, st.key, st.tenant, st.site, st.pool)
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	if err := writeNew(tmp, []byte(body), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
