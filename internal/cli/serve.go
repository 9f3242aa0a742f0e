package cli

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/wire"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/api"
	"github.com/better-compute/better-compute/internal/authz"
	bcdconfig "github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/server"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/tenancy"
)

func (a *app) logger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, errs.Invalid("--log-level", "want debug, info, warn or error")
	}
	return slog.New(slog.NewTextHandler(a.env.Stderr, &slog.HandlerOptions{Level: l})), nil
}

func signalContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
}

func (a *app) serveCmd() *cobra.Command {
	var path, level string
	var printConfig bool
	cmd := &cobra.Command{
		Use:   "serve --config FILE",
		Short: "Run the control plane API",
		Long: `Run the API from a TOML config (unknown keys are errors). The PKI bundle's
keys are decrypted with $BETTER_COMPUTE_SECRET. SIGINT/SIGTERM shut down
gracefully. --print-config prints a commented example.`,
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
			log, err := a.logger(level)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext(cmd.Context())
			defer cancel()
			return server.Run(ctx, cfg, server.Options{Log: log, Secret: []byte(a.env.Getenv(SecretEnv))})
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "TOML config file")
	cmd.Flags().StringVar(&level, "log-level", "info", "debug, info, warn or error")
	cmd.Flags().BoolVar(&printConfig, "print-config", false, "print an example config and exit")
	return cmd
}

// devState is what `dev` bootstraps and writes to dev.env.
type devState struct {
	key, tenant, site, pool string
}

func (a *app) devCmd() *cobra.Command {
	var dir, listen, gwListen, td, level string
	cmd := &cobra.Command{
		Use:   "dev [--data-dir DIR]",
		Short: "Run a complete local control plane on an embedded database",
		Long: `Run the API on an embedded SQLite database in a data directory, with
everything bootstrapped: the machine PKI, a root tenant, an admin API key, a
site and a bcd pool. It writes DIR/dev.env; after

    source DIR/dev.env

the CLI examples run as written (BETTER_COMPUTE_URL, BETTER_COMPUTE_API_KEY,
TENANT, SITE, POOL). It also runs a gateway and writes DIR/bcd/config.toml,
so that

    bcd join --config DIR/bcd/config.toml < join-token

joins this machine to it. Restarting on the same directory keeps everything.

For development only: the secret that encrypts the PKI's keys is kept in
DIR/dev-secret unless $BETTER_COMPUTE_SECRET is set.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := a.logger(level)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext(cmd.Context())
			defer cancel()
			return a.runDev(ctx, devOptions{dir: dir, listen: listen, gwListen: gwListen, td: td}, log)
		},
	}
	cmd.Flags().StringVar(&dir, "data-dir", "bc-dev", "data directory (created 0700)")
	cmd.Flags().StringVar(&listen, "listen", "127.0.0.1:8080", "API address (plain HTTP on loopback)")
	cmd.Flags().StringVar(&gwListen, "gateway-listen", "127.0.0.1:8443", "gateway address daemons join through (TLS)")
	cmd.Flags().StringVar(&td, "trust-domain", "dev.better-compute.internal", "SPIFFE trust domain of a new PKI")
	cmd.Flags().StringVar(&level, "log-level", "info", "debug, info, warn or error")
	return cmd
}

type devOptions struct {
	dir, listen, gwListen, td string
}

func (a *app) runDev(ctx context.Context, o devOptions, log *slog.Logger) error {
	dir, err := filepath.Abs(o.dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	sec, err := devSecret(dir, a.env.Getenv(SecretEnv))
	if err != nil {
		return err
	}
	pkiDir := filepath.Join(dir, "pki")
	if _, err := os.Stat(filepath.Join(pkiDir, pki.FileManifest)); errors.Is(err, fs.ErrNotExist) {
		if _, err := pki.Init(pkiDir, o.td, sec, time.Now()); err != nil {
			return err
		}
		log.Info("wrote the machine PKI", "dir", pkiDir, "trust_domain", o.td)
	}
	bundle, err := pki.Load(pkiDir, sec)
	if err != nil {
		return err
	}
	// The gateway's serving certificate and the API agent listener's, for
	// loopback; made once.
	for _, name := range []string{"gateway", "agent"} {
		crt, key := filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
		if _, err := os.Stat(crt); err == nil {
			continue
		}
		certPEM, keyPEM, err := pki.IssueGateway(bundle, []string{"127.0.0.1", "localhost"}, time.Now(), 365*24*time.Hour)
		if err != nil {
			return err
		}
		_ = os.Remove(key)
		if err := writeNew(key, keyPEM, 0o600); err != nil {
			return err
		}
		if err := writeNew(crt, certPEM, 0o644); err != nil {
			return err
		}
	}
	gwURL := "https://" + o.gwListen
	cfg := server.Config{
		Listen: o.listen, RootTenant: "root",
		Store:   store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:     server.PKIConfig{Dir: pkiDir},
		Agent:   server.AgentConfig{Listen: "127.0.0.1:0", CertFile: filepath.Join(dir, "agent.crt"), KeyFile: filepath.Join(dir, "agent.key")},
		Gateway: server.GatewayConfig{URL: gwURL},
		// dev enables every attestor that is built, so all of the page can be tried.
		Join: server.JoinConfig{Attestors: []string{wire.AttestorJoinToken, wire.AttestorX509Pop}},
	}
	envPath := filepath.Join(dir, "dev.env")
	var st devState
	gwErr := make(chan error, 1)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	err = server.Run(runCtx, cfg, server.Options{
		Log:    log,
		Secret: sec,
		Setup: func(ctx context.Context, s *api.Server, db *store.DB) error {
			var err error
			st, err = devBootstrap(ctx, s, db, envPath)
			return err
		},
		AgentReady: func(addr string) {
			g, err := gateway.New(gateway.Config{
				Listen: o.gwListen, CertFile: filepath.Join(dir, "gateway.crt"), KeyFile: filepath.Join(dir, "gateway.key"),
				APIURL: "https://" + addr, APICAFile: filepath.Join(pkiDir, pki.FileServingCACert),
			}, gateway.Options{Log: log.With("process", "gateway")})
			if err != nil {
				gwErr <- err
				cancel()
				return
			}
			go func() {
				if err := g.Run(runCtx); err != nil {
					gwErr <- err
					cancel()
				}
			}()
		},
		Ready: func(addr string) {
			url := "http://" + addr
			if err := writeDevEnv(envPath, url, st); err != nil {
				log.Error("write dev.env", "err", err)
				return
			}
			bcdConf, err := writeDevBCD(dir, gwURL, st.site, bundle)
			if err != nil {
				log.Error("write the bcd config", "err", err)
				return
			}
			fmt.Fprintf(a.env.Stdout, `
better-compute dev is running at %s%s (data in %s)
gateway for daemons: %s

  source %s
  better-compute join-tokens create --tenant $TENANT --pool $POOL --ttl 1h \
    --expect-serial SN-7701 --key adopt-rack-b7-u12 --out ./join-token
  better-compute join-tokens list --tenant $TENANT --pool $POOL
  better-compute events list --tenant $TENANT

Join this machine (a token without --expect-*, or one naming its own serial):
  better-compute join-tokens create --tenant $TENANT --pool $POOL --ttl 1h --out ./my-token
  bcd join --config %s < ./my-token
  bcd run --config %s          # the session, commands and renewals
  better-compute nodes list --tenant $TENANT

Stop with Ctrl-C; starting again on the same --data-dir keeps everything.
`, url, wire.DefaultBasePath, dir, gwURL, envPath, bcdConf, bcdConf)
		},
	})
	select {
	case gerr := <-gwErr:
		return fmt.Errorf("gateway: %w", gerr)
	default:
	}
	return err
}

// writeDevBCD writes DIR/bcd/config.toml and join-encryption.jwk for a
// daemon on this machine joining the dev control plane.
func writeDevBCD(dir, gwURL, site string, b *pki.Bundle) (string, error) {
	pins, err := b.Pins()
	if err != nil {
		return "", err
	}
	bdir := filepath.Join(dir, "bcd")
	if err := os.MkdirAll(bdir, 0o755); err != nil {
		return "", err
	}
	c := &bcdconfig.Config{
		GatewayURL: gwURL, Site: site, ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption,
		DataDir: filepath.Join(bdir, "data"),
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

// devSecret returns BETTER_COMPUTE_SECRET, or the development secret kept in
// the data directory (made on first start).
func devSecret(dir, env string) ([]byte, error) {
	if env != "" {
		return []byte(env), nil
	}
	p := filepath.Join(dir, "dev-secret")
	if b, err := os.ReadFile(p); err == nil {
		return []byte(strings.TrimSpace(string(b))), nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	var r [32]byte
	_, _ = rand.Read(r[:])
	s := base64.RawURLEncoding.EncodeToString(r[:])
	if err := writeNew(p, []byte(s+"\n"), 0o600); err != nil {
		return nil, err
	}
	return []byte(s), nil
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

func devBootstrap(ctx context.Context, s *api.Server, db *store.DB, envPath string) (devState, error) {
	var st devState
	ten := s.Tenancy()
	root, err := ten.RootTenantID(ctx)
	if err != nil {
		return st, err
	}
	st.tenant = root
	sys := authz.Principal{ID: "system:dev", TenantID: root, Name: "dev", Grants: authz.Admin, Root: true}
	prev := readDevEnv(envPath)
	if k := prev["BETTER_COMPUTE_API_KEY"]; k != "" {
		if p, err := authz.Authenticate(ctx, db, k); err == nil && p.TenantID == root {
			st.key = k
		}
	}
	if st.key == "" {
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			now, err := tx.Now(ctx)
			if err != nil {
				return err
			}
			_, st.key, err = authz.NewKey(ctx, tx, root, fmt.Sprintf("dev-admin-%d", now.Unix()), authz.Admin, 0, now)
			return err
		})
		if err != nil {
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

func writeDevEnv(path, url string, st devState) error {
	body := fmt.Sprintf(`# Written by better-compute dev. Use it with: source %s
export BETTER_COMPUTE_URL=%s
export BETTER_COMPUTE_API_KEY=%s
export TENANT=%s
export SITE=%s
export POOL=%s
`, path, url, st.key, st.tenant, st.site, st.pool)
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	if err := writeNew(tmp, []byte(body), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
