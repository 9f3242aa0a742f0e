package bcdcmd

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tokeninput"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

type joinFlags struct {
	configPath string
	dataDir    string
	sysfsRoot  string
	procfsRoot string
	tokenFile  string
	server     string
	// serverCAFile holds PEM CAs that verify --server instead of the
	// system roots.
	serverCAFile string
	// configSeed is copied to --config when that does not exist, and
	// skipIfJoined ends a join on a machine that has an identity: the
	// DaemonSet's init container, which has no shell, runs bcd join on
	// every pod start.
	configSeed   string
	skipIfJoined bool
	nodeID       string
	attestor     string
	role         string
	reset        bool
	yes          bool
	json         bool
	// The discovery attestor's boot (R10.4).
	bootMAC, bootIP, workflowID string
	bootLeaseEpoch              int64
	// The host build (R11.3).
	site, servingCAPin, joinSigningPin, joinEncryptionPin string
}

// howToGiveToken is said wherever a token is missing or misplaced.
const howToGiveToken = "pipe it on standard input (bcd join < join-token), set BCD_JOIN_TOKEN, or pass --token-file FILE"

func (a *app) joinCmd() *cmdline.Command {
	var f joinFlags
	cmd := &cmdline.Command{
		Use:   "join",
		Short: "Join this machine to its pool with a join token",
		Long: `Join this machine to its pool: make the node key, send the sealed token, the
certificate request and the hardware claims to the gateway, check the signed
answer and save the identity in the data directory.

The token is read from standard input, BCD_JOIN_TOKEN, or --token-file (a
0600/0400 file, deleted after the join); never from an argument.

On a host without config.toml, --server with --site and the three pins builds
the configuration from the control plane's well-known document and writes it
after the join.

--reset --yes joins anew although this machine has an identity. The old
identity stays in place, and bcd run keeps using it, until the new one is
saved; then it is moved aside to <data_dir>/reset-<time>/. A refused join
leaves it as it was. Without a token, --reset --yes only moves the identity
aside.

A join whose answer is lost (the gateway or the network failed, bcd was
stopped) is sent again, the very same request, while the failure is
transient; the request is kept in <data_dir>/join.pending until its answer
is saved, and bcd join with the same token sends it again, so an answer that
landed is picked up and nothing is spent twice.

--attestor x509pop brings back a node whose certificate expired while the
machine was offline (a certificate that is still valid renews: bcd renew). It
takes no token: it proves possession of the expired certificate's key, which
the control plane accepts within 7 days of the expiry when it runs the x509pop
attestor. The node keeps its id; the expired identity is moved aside once the
answer checked out.

--attestor discovery --role ramdisk joins a ramdisk the site booted over the
network, with the site's ramdisk token (--token-file, as the boot image got
it) and the boot the site agent vouched for (--boot-mac, --boot-ip,
--boot-lease-epoch). When the pool wants a person to decide, the control plane
answers with a join request: bcd prints its id, waits, and asks again with the
same key and certificate request until the request is approved (the join
then completes on its own), rejected (bcd exits non-zero), or bcd is stopped;
bcd join again with the same token keeps waiting on the same request.

--attestor tpm joins with no token, on a machine whose config.toml opens a
TPM ([tpm], docs/tpm.md): the node key is made in the TPM and certified by
its attestation key, and the control plane's credential challenge is
answered by the TPM. An endorsement key the control plane does not know yet
may become a join request: bcd waits on it as above.`,
		Example: `  bcd join --config /etc/bcd/config.toml < join-token
  bcd join --server https://compute.example.com --token-file /run/bcd/token --node-id node_…
  bcd join --config /etc/bcd/config.toml --reset --yes < join-token
  bcd join --config /etc/bcd/config.toml --attestor x509pop
  bcd join --config /etc/bcd/config.toml --attestor tpm
  bcd join --attestor discovery --role ramdisk --token-file /run/bcd/ramdisk-token \
    --boot-mac 52:54:00:12:34:56 --boot-ip 10.0.0.7 --boot-lease-epoch 3`,
		Args: refuseTokenArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error { return a.join(cmd.Context(), &f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml; join-encryption.jwk is read beside it")
	fl.StringVar(&f.dataDir, "data-dir", "", "the identity's directory (default: the config's data_dir, else "+bcdconfig.DefaultDataDir+")")
	fl.StringVar(&f.sysfsRoot, "sysfs-root", "", "where the host's /sys is mounted, for the hardware claims (default: the config's sysfs_root, else /sys)")
	fl.StringVar(&f.procfsRoot, "procfs-root", "", "where the host's /proc is mounted (default: the config's procfs_root, else /proc)")
	fl.StringVar(&f.tokenFile, "token-file", "", "read the token from this 0600/0400 file and delete it after the join")
	fl.StringVar(&f.server, "server", "", "the control plane's URL, for its well-known document (the join key when join-encryption.jwk is absent; the whole config when config.toml is)")
	fl.StringVar(&f.serverCAFile, "server-ca-file", "", "PEM CAs --server's certificate must come from; without it (or with an empty file) the certificate is not checked, since the document is trusted only through the pins")
	fl.StringVar(&f.configSeed, "config-seed", "", "copy this file to --config first when --config does not exist (a DaemonSet's ConfigMap)")
	fl.BoolVar(&f.skipIfJoined, "skip-if-joined", false, "exit 0 without joining when this machine already has an identity (a DaemonSet's init container)")
	fl.StringVar(&f.nodeID, "node-id", "", "the node a deploy created for this machine; the join must land on it")
	fl.StringVar(&f.attestor, "attestor", "", "the attestor: join-token (default), tpm to join with this machine's TPM and no token, discovery for a ramdisk its site booted, or x509pop to re-join with an expired certificate")
	fl.StringVar(&f.bootMAC, "boot-mac", "", "discovery: the MAC of the NIC the machine booted from")
	fl.StringVar(&f.bootIP, "boot-ip", "", "discovery: the address the boot lease gave")
	fl.Int64Var(&f.bootLeaseEpoch, "boot-lease-epoch", 0, "discovery: the boot lease's epoch, as the site's boot configuration gave it")
	fl.StringVar(&f.workflowID, "workflow-id", "", "discovery: the site's provisioning workflow, when it names one")
	fl.StringVar(&f.role, "role", "", "the requested role: node (default), site, ramdisk or node-tenant")
	fl.BoolVar(&f.reset, "reset", false, "join anew although joined; the old identity is moved aside once the new one is saved (needs --yes)")
	fl.BoolVar(&f.yes, "yes", false, "confirm --reset")
	fl.BoolVar(&f.json, "json", false, "print the new identity as JSON on standard output")
	fl.StringVar(&f.site, "site", "", "host build: the site id, site_…")
	fl.StringVar(&f.servingCAPin, "serving-ca-pin", "", "host build: the serving CA pin, sha256/…")
	fl.StringVar(&f.joinSigningPin, "join-signing-pin", "", "host build: the join-signing key pin, sha256/…")
	fl.StringVar(&f.joinEncryptionPin, "join-encryption-pin", "", "host build: the join-encryption key pin, sha256/…")
	return cmd
}

// refuseTokenArgs refuses every positional argument, and says why a token
// must never be one (R11.2). No message repeats an argument: it may be a
// mistyped token.
func refuseTokenArgs(_ *cmdline.Command, args []string) error {
	for _, arg := range args {
		if _, err := tokeninput.Parse(arg); err == nil || strings.HasPrefix(strings.TrimSpace(arg), "bcjt_") {
			return errs.New(errs.InvalidArgument,
				"never pass the join token as an argument: every user of this machine can read it in the process list, and it stays in the shell history. Revoke that token (better-compute join-tokens revoke jt_…), create a new one, and %s", howToGiveToken)
		}
	}
	if len(args) > 0 {
		return errs.New(errs.InvalidArgument, "bcd join takes no arguments (%d given); for the token, %s", len(args), howToGiveToken)
	}
	return nil
}

// boot is the discovery attestor's boot, nil when no --boot-… flag is set.
func (f *joinFlags) boot() *enroll.Boot {
	if f.bootMAC == "" && f.bootIP == "" && f.bootLeaseEpoch == 0 && f.workflowID == "" {
		return nil
	}
	return &enroll.Boot{MAC: f.bootMAC, IP: f.bootIP, LeaseEpoch: f.bootLeaseEpoch, WorkflowID: f.workflowID}
}

func (f *joinFlags) bootstrap(dataDir, sysfsRoot, procfsRoot string) *enroll.Bootstrap {
	if f.site == "" && f.servingCAPin == "" && f.joinSigningPin == "" && f.joinEncryptionPin == "" {
		return nil
	}
	return &enroll.Bootstrap{
		Site: f.site, ServingCAPin: f.servingCAPin, JoinSigningPin: f.joinSigningPin, JoinEncryptionPin: f.joinEncryptionPin,
		DataDir: dataDir, SysfsRoot: sysfsRoot, ProcfsRoot: procfsRoot,
	}
}

func (a *app) join(ctx context.Context, f *joinFlags) error {
	switch {
	case f.reset && !f.yes:
		return errs.New(errs.InvalidArgument,
			"--reset moves this machine's identity aside: it stops being its node, and only a new join with a new token makes it one again. To go ahead: bcd join --reset --yes")
	case f.yes && !f.reset:
		return errs.New(errs.InvalidArgument, "--yes only confirms --reset")
	}

	if err := seedConfig(f.configPath, f.configSeed); err != nil {
		return err
	}
	cfg, err := loadConfig(f.configPath)
	if err != nil {
		return err
	}
	cfg, d, err := withDirFlags(cfg, f)
	if err != nil {
		return err
	}
	dataDir, sysfsRoot, procfsRoot, storeDir := d.data, d.sysfs, d.procfs, d.store
	if f.skipIfJoined {
		if _, err := os.Stat(filepath.Join(storeDir, identity.IdentityFile)); err == nil {
			fmt.Fprintf(a.env.Stderr, "this machine already joined (%s): nothing to do; bcd run takes over\n", storeDir)
			return nil
		}
	}

	now := a.env.Clock.Now
	keys, store, err := tpmkeys.Stores(cfg, storeDir)
	if err != nil {
		return err
	}
	httpClient, stopTracing, err := a.traced(cfg)
	if err != nil {
		return err
	}
	defer stopTracing()
	j, err := enroll.New(enroll.Config{
		BCD: cfg, ConfigPath: f.configPath, Store: store, Keys: keys,
		Clock: a.env.Clock, HTTPClient: httpClient, Log: a.log,
		Progress: func(line string) { fmt.Fprintln(a.env.Stderr, line) },
	})
	if err != nil {
		return err
	}

	if f.attestor == identity.AttestorX509Pop {
		return a.rejoin(ctx, j, f, storeDir)
	}
	cas, err := serverCAs(f.server, f.serverCAFile)
	if err != nil {
		return err
	}

	// The token before the reset: a missing or malformed one must not
	// leave the machine without its identity. A tpm join takes none.
	tpmJoin := f.attestor == identity.AttestorTPM
	var token string
	var cleanup func() (string, error)
	if tpmJoin {
		if f.tokenFile != "" {
			return errs.New(errs.InvalidArgument, "--attestor tpm takes no join token: the TPM proves the machine instead")
		}
	} else if token, cleanup, err = a.readToken(f.tokenFile); err != nil {
		return err
	}

	// --reset --yes without a token only moves the identity aside. With a
	// token, Join keeps the identity in place until the new one is saved.
	if f.reset && token == "" && !tpmJoin {
		dir, err := j.Reset(now())
		switch {
		case errors.Is(err, identity.ErrNotJoined):
			fmt.Fprintf(a.env.Stderr, "nothing to reset: no identity in %s\n", storeDir)
		case err != nil:
			return err
		default:
			fmt.Fprintf(a.env.Stderr, "moved the old identity aside to %s\n", dir)
		}
		fmt.Fprintf(a.env.Stderr, "now join with a new token: %s\n", howToGiveToken)
		return nil
	}
	if token == "" && !tpmJoin {
		return errs.New(errs.InvalidArgument, "no join token: %s", howToGiveToken)
	}

	id, err := j.Join(ctx, enroll.Options{
		Token: token, Attestor: f.attestor, Role: f.role, NodeID: f.nodeID, Server: f.server, ServerCAs: cas,
		Bootstrap: f.bootstrap(dataDir, sysfsRoot, procfsRoot), Reset: f.reset, Boot: f.boot(),
	})
	if id == nil {
		return err
	}
	// The token is spent: delete its file (R11.2). A file we may not
	// delete (a read-only Secret mount) is a warning.
	if cleanup != nil {
		warning, cerr := cleanup()
		if warning != "" {
			fmt.Fprintf(a.env.Stderr, "warning: %s\n", warning)
		}
		if cerr != nil {
			fmt.Fprintf(a.env.Stderr, "warning: could not delete the token file: %v\n", cerr)
		}
	}
	fmt.Fprintf(a.env.Stderr, "joined as %s (%s), certificate valid until %s\n", id.NodeID, id.SPIFFEID, id.NotAfter.Format(time.RFC3339))
	if err != nil {
		// Joined, but a host build could not write its configuration.
		return err
	}
	if f.json {
		return printJSON(a.env.Stdout, statusOf(id, storeDir, now()))
	}
	return nil
}

// joinDirs are the directories a join uses: the --data-dir, --sysfs-root
// and --procfs-root flags (absolute), and the identity's directory.
type joinDirs struct{ data, sysfs, procfs, store string }

// withDirFlags applies the directory flags over config.toml's local keys.
func withDirFlags(cfg *bcdconfig.Config, f *joinFlags) (*bcdconfig.Config, joinDirs, error) {
	var d joinDirs
	var err error
	for _, x := range []struct {
		flag, val string
		dst       *string
	}{{"--data-dir", f.dataDir, &d.data}, {"--sysfs-root", f.sysfsRoot, &d.sysfs}, {"--procfs-root", f.procfsRoot, &d.procfs}} {
		if *x.dst, err = absDir(x.flag, x.val); err != nil {
			return nil, d, err
		}
	}
	d.store = d.data
	if cfg != nil {
		// The flags override the file's local keys.
		c := *cfg
		for _, o := range []struct {
			dst *string
			val string
		}{{&c.DataDir, d.data}, {&c.SysfsRoot, d.sysfs}, {&c.ProcfsRoot, d.procfs}} {
			if o.val != "" {
				*o.dst = o.val
			}
		}
		cfg = &c
		d.store = cfg.DataDir
	}
	if d.store == "" {
		d.store = bcdconfig.DefaultDataDir
	}
	return cfg, d, nil
}

// rejoin is `bcd join --attestor x509pop` (R10.5): no token, the expired
// identity is the evidence.
func (a *app) rejoin(ctx context.Context, j *enroll.Joiner, f *joinFlags, storeDir string) error {
	switch {
	case f.reset:
		return errs.New(errs.InvalidArgument,
			"--attestor x509pop re-joins with the expired identity, so it cannot be reset first; bcd moves it aside itself once the control plane answered")
	case f.tokenFile != "":
		return errs.New(errs.InvalidArgument, "--attestor x509pop takes no join token: it proves possession of the expired certificate's key instead")
	case f.server != "" || f.bootstrap("", "", "") != nil:
		return errs.New(errs.InvalidArgument, "--attestor x509pop re-joins with the existing configuration: leave out --server, --site and the pin flags")
	}
	id, err := j.Join(ctx, enroll.Options{Attestor: identity.AttestorX509Pop, Role: f.role, NodeID: f.nodeID})
	if err != nil {
		return err
	}
	fmt.Fprintf(a.env.Stderr, "re-joined as %s (%s), certificate valid until %s\n", id.NodeID, id.SPIFFEID, id.NotAfter.Format(time.RFC3339))
	if f.json {
		return printJSON(a.env.Stdout, statusOf(id, storeDir, a.env.Clock.Now()))
	}
	return nil
}

// readToken returns the token from --token-file, BCD_JOIN_TOKEN or standard
// input (when it is not a terminal), in that order; "" when none gave one.
// Two explicit sources are refused rather than one silently preferred.
// cleanup, for --token-file only, deletes the file.
func (a *app) readToken(tokenFile string) (token string, cleanup func() (string, error), err error) {
	envToken, envSet, envErr := tokeninput.FromEnv(a.env.LookupEnv)
	if envSet {
		// Child processes never inherit the token.
		_ = a.env.Unsetenv(tokeninput.EnvVar)
	}
	if tokenFile != "" {
		if envSet {
			return "", nil, errs.New(errs.InvalidArgument, "both --token-file and %s are set: give the token one way", tokeninput.EnvVar)
		}
		return tokeninput.FromFile(tokenFile)
	}
	if envSet {
		return envToken, nil, envErr
	}
	if a.env.StdinIsTerminal() {
		return "", nil, nil
	}
	// Read it here, bounded, so an empty standard input (bcd join --reset
	// --yes </dev/null, a service without input) means "no token".
	data, err := io.ReadAll(io.LimitReader(a.env.Stdin, tokeninput.MaxSize+1))
	if err != nil {
		return "", nil, errs.Wrap(err, errs.InvalidArgument, "cannot read the join token from standard input: %v", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return "", nil, nil
	}
	tok, err := tokeninput.FromStdin(bytes.NewReader(data))
	return tok, nil, err
}

// loadConfig loads config.toml; nil without error when there is none
// (R11.3).
func loadConfig(path string) (*bcdconfig.Config, error) {
	cfg, err := bcdconfig.Load(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return cfg, err
}

// absDir returns the directory a flag names, made absolute ("" stays "").
func absDir(flag, dir string) (string, error) {
	if dir == "" {
		return "", nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", errs.Invalid(flag, "%v", err)
	}
	return abs, nil
}

// serverCAs reads --server-ca-file: the CAs --server's TLS certificate
// must come from, when an operator wants the chain checked too. Without
// it the certificate is not checked: the document fetched is trusted only
// through the pins, whatever TLS says.
func serverCAs(server, file string) (*x509.CertPool, error) {
	if file == "" {
		return nil, nil
	}
	if server == "" {
		return nil, errs.Invalid("--server-ca-file", "verifies --server's certificate: give --server too")
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, errs.Invalid("--server-ca-file", "%v", err)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		// An empty file is no file: a manifest can name the file whether
		// or not an operator filled it.
		return nil, nil
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, errs.Invalid("--server-ca-file", "%s holds no PEM certificate", file)
	}
	return pool, nil
}

// seedConfig copies seed to path when path does not exist (never over an
// existing config: bcd keeps the host's copy up to date itself).
func seedConfig(path, seed string) error {
	if seed == "" {
		return nil
	}
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	data, err := os.ReadFile(seed)
	if err != nil {
		return errs.Invalid("--config-seed", "%v", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".seed"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
