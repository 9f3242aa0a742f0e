// Package join is bcd's side of the join flow (R4.1–R4.3, R4.6,
// R11.1–R11.4): it makes the node key and CSR, collects the hardware
// claims, seals the join token to the pinned JoinService encryption key,
// calls JoinService.Join through the gateway over TLS pinned to the serving
// CA, checks the signed answer in the page's order, and saves the identity.
//
// It also implements the well-known fallback: with --server, the
// encryption key (when join-encryption.jwk is absent) and, on a host with no
// config.toml, the gateway come from the control plane's well-known
// document, and nothing in it is used unless it matches a pin.
//
// SECURITY: bcd's only trust anchors are the three pins. The gateway is
// authenticated by the serving CA pin alone (PinnedTLSConfig), the token is
// readable only by the holder of the pinned encryption key, and the answer
// is accepted only under the pinned join-signing key. Nothing is written to
// the data directory until every check passed.
package join

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/better-compute/better-compute/internal/wire"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/bcd/claims"
	"github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	"github.com/better-compute/better-compute/internal/clock"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/hwid"
	"github.com/better-compute/better-compute/internal/ids"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/version"
)

const (
	// joinTimeout bounds the Join call, TLS handshake included.
	joinTimeout = 2 * time.Minute
	// maxResponseSize bounds the JoinResponse read from the gateway; a real
	// one is a few KiB.
	maxResponseSize = 1 << 20
)

// HTTPClientFunc returns an HTTP client whose transport uses tlsConfig
// (nil: Go's default TLS verification against the system roots, used for
// the well-known fetch). The gateway client must use tlsConfig as given:
// it carries the pinned verification. The client must speak HTTP/2 over
// TLS for the gateway (gRPC).
type HTTPClientFunc func(tlsConfig *tls.Config) *http.Client

// DefaultHTTPClient is the production HTTPClientFunc: a fresh transport
// (proxy from the environment, HTTP/2 when the server offers it) per call.
func DefaultHTTPClient(tlsConfig *tls.Config) *http.Client {
	return &http.Client{Transport: &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		TLSClientConfig:       tlsConfig,
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   15 * time.Second,
		ResponseHeaderTimeout: joinTimeout,
		IdleConnTimeout:       30 * time.Second,
	}}
}

// Config lists a Joiner's dependencies.
type Config struct {
	// BCD is the loaded configuration, or nil when there is no config.toml:
	// Join then builds one from the well-known document (R11.3) and needs
	// Options.Server and Options.Bootstrap.
	BCD *config.Config
	// ConfigPath is config.toml's path (config.DefaultPath when empty);
	// join-encryption.jwk is read from, and in a host build written to,
	// its directory.
	ConfigPath string
	// Store is the identity's data directory. Its TPMKeys must be set when
	// Keys makes TPM keys, so the saved identity can be reopened.
	Store *identity.Store
	// Keys makes the node key; nil means identity.SoftwareKeys.
	Keys identity.KeyStore
	// Clock is the time source; nil means the wall clock.
	Clock clock.Clock
	// HTTPClient makes the HTTP clients; nil means DefaultHTTPClient.
	HTTPClient HTTPClientFunc
	// Log receives warnings (claims that could not be read, ...); nil
	// discards them.
	Log *slog.Logger
	// Progress, when set, receives a short line before each step, for the
	// CLI to print.
	Progress func(line string)
}

// Joiner joins this machine; build it with New.
type Joiner struct {
	cfg        Config
	keys       identity.KeyStore
	clock      clock.Clock
	httpClient HTTPClientFunc
	log        *slog.Logger
}

// New returns a Joiner for cfg. cfg.Store is required.
func New(cfg Config) (*Joiner, error) {
	if cfg.Store == nil || cfg.Store.Dir == "" {
		return nil, errs.New(errs.InvalidConfig, "join: no data directory")
	}
	if cfg.ConfigPath == "" {
		cfg.ConfigPath = config.DefaultPath
	}
	j := &Joiner{cfg: cfg, keys: cfg.Keys, clock: cfg.Clock, httpClient: cfg.HTTPClient, log: cfg.Log}
	if j.keys == nil {
		j.keys = identity.SoftwareKeys{}
	}
	if j.clock == nil {
		j.clock = clock.Real{}
	}
	if j.httpClient == nil {
		j.httpClient = DefaultHTTPClient
	}
	if j.log == nil {
		j.log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return j, nil
}

// Options are one `bcd join`.
type Options struct {
	// Token is the join token, bcjt_…; required for the join-token
	// attestor.
	Token string
	// Attestor is the attestor name; empty means join-token.
	Attestor string
	// Role is the requested role; empty means node.
	Role string
	// NodeID, when set, is the node a deploy created for this machine: the
	// join must land on it (R11.3).
	NodeID string
	// Server is the control plane's URL, for the well-known fallback.
	Server string
	// Bootstrap is required when there is no config.toml (Config.BCD nil)
	// and refused otherwise.
	Bootstrap *Bootstrap
}

// Bootstrap is what a host build (R11.3) takes from the command line: the
// site and the pins never come from the well-known document.
type Bootstrap struct {
	Site              string
	ServingCAPin      string
	JoinSigningPin    string
	JoinEncryptionPin string
	// DataDir, SysfsRoot and ProcfsRoot are written into the new
	// config.toml when set; empty means the defaults. DataDir must be the
	// Store's directory.
	DataDir    string
	SysfsRoot  string
	ProcfsRoot string
}

func (j *Joiner) progress(format string, args ...any) {
	if j.cfg.Progress != nil {
		j.cfg.Progress(fmt.Sprintf(format, args...))
	}
}

// claimsAndKey collects the machine's hardware claims and makes the new node
// key and its certificate request.
func (j *Joiner) claimsAndKey(cfg *config.Config) (hwid.Claims, crypto.Signer, []byte, []byte, error) {
	j.progress("collecting hardware claims…")
	cl, warnings, err := claims.Collect(cfg.SysfsRoot, cfg.ProcfsRoot)
	for _, w := range warnings {
		j.log.Warn("hardware claim", "warning", w)
	}
	if err != nil {
		return cl, nil, nil, nil, err
	}
	signer, keyRecord, err := j.keys.GenerateKey()
	if err != nil {
		return cl, nil, nil, nil, fmt.Errorf("make the node key: %w", err)
	}
	csr, err := identity.NewCSR(signer, cl.Hostname)
	if err != nil {
		// The hostname is only a hint for people reading logs.
		if csr, err = identity.NewCSR(signer, ""); err != nil {
			return cl, nil, nil, nil, fmt.Errorf("make the certificate request: %w", err)
		}
	}
	return cl, signer, keyRecord, csr, nil
}

// Reset moves the identity aside (`bcd join --reset --yes`, R11.4) and
// returns the directory that now holds it. It returns an error matching
// identity.ErrNotJoined when there is no identity.
func (j *Joiner) Reset(now time.Time) (string, error) {
	return j.cfg.Store.MoveAside(now)
}

// Join joins this machine and returns the saved identity. See the package
// comment for the steps; every failure is an *errs.E that says what to do.
func (j *Joiner) Join(ctx context.Context, opts Options) (*identity.Identity, error) {
	role, wireAttestor, err := checkOptions(opts)
	if err != nil {
		return nil, err
	}
	if wireAttestor == identity.AttestorX509Pop {
		return j.rejoin(ctx, opts)
	}
	if err := j.refuseJoined(); err != nil {
		return nil, err
	}

	// The configuration: config.toml, or built from the well-known
	// document (R11.3).
	var (
		cfg *config.Config
		wk  *wellKnown
	)
	if j.cfg.BCD == nil {
		if cfg, wk, err = j.buildConfig(ctx, opts); err != nil {
			return nil, err
		}
	} else {
		if opts.Bootstrap != nil {
			return nil, errs.New(errs.InvalidArgument,
				"%s exists: --site and the pin flags only build a configuration on a host without one", j.cfg.ConfigPath)
		}
		c := *j.cfg.BCD
		c.ApplyDefaults()
		if err := c.Validate(); err != nil {
			return nil, err
		}
		cfg = &c
	}

	encKey, wk, err := j.encryptionKey(ctx, cfg, opts.Server, wk)
	if err != nil {
		return nil, err
	}

	cl, signer, keyRecord, csr, err := j.claimsAndKey(cfg)
	if err != nil {
		return nil, err
	}

	j.progress("sealing the token…")
	sealed, err := pki.Seal(encKey, opts.Token, csr, j.clock.Now())
	if err != nil {
		return nil, fmt.Errorf("seal the token: %w", err)
	}

	req := &agentv1.JoinRequest{
		SealedToken: sealed,
		Csr:         csr,
		Claims:      wireClaims(cl),
		Attestor:    wireAttestor,
		Role:        role,
		NodeId:      opts.NodeID,
		Protocol:    version.ProtocolMax,
	}
	res, err := j.call(ctx, cfg, req)
	if err != nil {
		return nil, err
	}

	var docCert *x509.Certificate
	if wk != nil {
		docCert = wk.signingCert
	}
	body, err := verifyResponse(res, expectation{
		signingPin: cfg.JoinSigningKeyPin,
		docCert:    docCert,
		csrHash:    pki.CSRHash(csr),
		nodeKey:    signer.Public(),
		siteID:     cfg.Site,
		nodeID:     opts.NodeID,
		role:       role,
	})
	if err != nil {
		return nil, err
	}

	id, err := j.save(body, keyRecord, opts.Attestor)
	if err != nil {
		return nil, err
	}
	if j.cfg.BCD == nil {
		if err := j.writeConfig(cfg, encKey, opts.Bootstrap); err != nil {
			return id, err
		}
	}
	return id, nil
}

// checkOptions returns the role and the attestor to send.
func checkOptions(opts Options) (role, attestor string, err error) {
	role = opts.Role
	if role == "" {
		role = pki.RoleNode
	}
	if !pki.ValidRole(role) {
		return "", "", errs.Invalid("--role", "want node, site, ramdisk or node-tenant")
	}
	switch opts.Attestor {
	case "", identity.AttestorJoinToken:
		// The wire's empty attestor is the join token.
	case identity.AttestorX509Pop:
		// R10.5: the expired identity is the evidence; rejoin checks the
		// rest against it.
		if opts.Token != "" {
			return "", "", errs.New(errs.InvalidArgument, "--attestor x509pop takes no join token: it proves possession of the expired certificate's key instead")
		}
		if opts.NodeID != "" && !ids.Valid(ids.Node, opts.NodeID) {
			return "", "", errs.Invalid("--node-id", "want a node id like node_01k5w…")
		}
		return role, identity.AttestorX509Pop, nil
	default:
		return "", "", errs.Invalid("--attestor", "this bcd joins with a join token (attestor %s; leave --attestor out), or re-joins after its certificate expired with %s", identity.AttestorJoinToken, identity.AttestorX509Pop)
	}
	if opts.Token == "" {
		return "", "", errs.New(errs.InvalidArgument, "no join token: pipe it on standard input (bcd join < join-token), or use BCD_JOIN_TOKEN or --token-file")
	}
	if opts.NodeID != "" && !ids.Valid(ids.Node, opts.NodeID) {
		return "", "", errs.Invalid("--node-id", "want a node id like node_01k5w…")
	}
	return role, "", nil
}

// refuseJoined answers "already joined" when an identity loads (an expired
// one too: the page says bcd keeps it), and passes on a damaged identity's
// error, which names the fix.
func (j *Joiner) refuseJoined() error {
	id, err := j.cfg.Store.Load()
	switch {
	case err == nil:
		expired := ""
		if id.Expired(j.clock.Now()) {
			expired = fmt.Sprintf("; its certificate expired at %s", id.NotAfter.Format(time.RFC3339))
		}
		return errs.New(errs.InvalidState, "already joined as %s (SPIFFE ID %s)%s; to join again: bcd join --reset --yes",
			id.NodeID, id.SPIFFEID, expired)
	case errors.Is(err, identity.ErrNotJoined):
		return nil
	default:
		return err
	}
}

// buildConfig is the host build of R11.3: the gateway from the well-known
// document, the site and pins from the command line, and a document whose
// pins differ from them refused.
func (j *Joiner) buildConfig(ctx context.Context, opts Options) (*config.Config, *wellKnown, error) {
	b := opts.Bootstrap
	if opts.Server == "" || b == nil {
		return nil, nil, errs.New(errs.InvalidConfig,
			"no bcd config at %s: install bcd with its install script, or build the config from the control plane with bcd join --server URL --site SITE --serving-ca-pin PIN --join-signing-pin PIN --join-encryption-pin PIN",
			j.cfg.ConfigPath)
	}
	var missing []string
	for _, f := range []struct{ flag, val string }{
		{"--site", b.Site}, {"--serving-ca-pin", b.ServingCAPin},
		{"--join-signing-pin", b.JoinSigningPin}, {"--join-encryption-pin", b.JoinEncryptionPin},
	} {
		if f.val == "" {
			missing = append(missing, f.flag)
		}
	}
	if len(missing) > 0 {
		return nil, nil, errs.New(errs.InvalidArgument,
			"no bcd config at %s, so bcd join --server builds one, and needs %v: the pins come from the install, never from the server", j.cfg.ConfigPath, missing)
	}
	for _, p := range []struct{ flag, val string }{
		{"--serving-ca-pin", b.ServingCAPin}, {"--join-signing-pin", b.JoinSigningPin}, {"--join-encryption-pin", b.JoinEncryptionPin},
	} {
		if !pki.ValidPin(p.val) {
			return nil, nil, errs.Invalid(p.flag, "want sha256/<base64 of a SHA-256>")
		}
	}

	wk, err := j.fetchWellKnown(ctx, opts.Server, b.JoinEncryptionPin, b.JoinSigningPin)
	if err != nil {
		return nil, nil, err
	}
	g := wk.doc.Gateway
	if g == nil || g.URL == "" {
		return nil, nil, errs.New(errs.InvalidConfig, "%s has no gateway section: the control plane's options do not name a gateway (gateway: { url })", wk.url)
	}
	// SECURITY: the document only says where; the pins say who.
	var differ []string
	if g.ServingCAPin != b.ServingCAPin {
		differ = append(differ, "gateway.servingCaPin differs from --serving-ca-pin")
	}
	if wk.doc.Join.SigningKeyPin != b.JoinSigningPin {
		differ = append(differ, "join.signingKeyPin differs from --join-signing-pin")
	}
	if wk.doc.Join.EncryptionKeyPin != b.JoinEncryptionPin {
		differ = append(differ, "join.encryptionKeyPin differs from --join-encryption-pin")
	}
	if len(differ) > 0 {
		return nil, nil, errs.New(errs.InvalidConfig,
			"refusing the well-known document at %s: %v; it belongs to another PKI, or the pins of this install are stale", wk.url, differ)
	}
	c := &config.Config{
		GatewayURL:           g.URL,
		GatewayServerName:    g.ServerName,
		Site:                 b.Site,
		ServingCASPKIPin:     b.ServingCAPin,
		JoinSigningKeyPin:    b.JoinSigningPin,
		JoinEncryptionKeyPin: b.JoinEncryptionPin,
		DataDir:              b.DataDir,
		SysfsRoot:            b.SysfsRoot,
		ProcfsRoot:           b.ProcfsRoot,
	}
	c.ApplyDefaults()
	if err := c.Validate(); err != nil {
		e, _ := errs.As(err)
		return nil, nil, errs.New(errs.InvalidConfig, "the configuration built from %s and the flags is not valid: %s", wk.url, e.Message)
	}
	return c, wk, nil
}

// writeConfig writes join-encryption.jwk, then config.toml, after a host
// build's join (R11.3). config.toml last: its presence means the install
// is complete.
func (j *Joiner) writeConfig(cfg *config.Config, encKey *ecdsa.PublicKey, b *Bootstrap) error {
	dir := filepath.Dir(j.cfg.ConfigPath)
	out := *cfg
	// Keep defaults out of the file, so a later bcd with other defaults
	// is not pinned to these.
	out.DataDir, out.SysfsRoot, out.ProcfsRoot, out.TPM = b.DataDir, b.SysfsRoot, b.ProcfsRoot, config.TPM{}
	fail := func(err error) error {
		return errs.New(errs.InvalidState, "joined, but could not write the configuration in %s: %s; the daemon cannot start without it: write it by hand (the install script's config.toml), or run bcd join --reset --yes and join again with a new token",
			dir, errText(err))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fail(err)
	}
	if err := config.WriteEncryptionKey(dir, cfg.JoinEncryptionKeyPin, encKey); err != nil {
		return fail(err)
	}
	if err := out.Write(j.cfg.ConfigPath); err != nil {
		return fail(err)
	}
	return nil
}

// encryptionKey returns the JoinService encryption key (R11.1):
// join-encryption.jwk beside config.toml when it matches the pin; when the
// file is absent, the well-known document's key when --server is given and
// it matches; otherwise an error saying both ways. A present file that does
// not match fails and never falls back. It returns the document when it
// fetched it, or wk as given.
func (j *Joiner) encryptionKey(ctx context.Context, cfg *config.Config, server string, wk *wellKnown) (*ecdsa.PublicKey, *wellKnown, error) {
	dir := filepath.Dir(j.cfg.ConfigPath)
	key, found, err := config.LoadEncryptionKey(dir, cfg.JoinEncryptionKeyPin)
	if err != nil {
		return nil, wk, err
	}
	if found {
		return key, wk, nil
	}
	if wk == nil {
		if server == "" {
			return nil, nil, errs.New(errs.InvalidConfig,
				"no JoinService encryption key: %s is missing; install it (the install script writes it), or pass --server with the control plane's URL to fetch it from its well-known document",
				filepath.Join(dir, config.EncryptionKeyFile))
		}
		if wk, err = j.fetchWellKnown(ctx, server, cfg.JoinEncryptionKeyPin, cfg.JoinSigningKeyPin); err != nil {
			return nil, nil, err
		}
	}
	return wk.encKey, wk, nil
}

// call dials the gateway over pinned TLS and calls Join. Server errors come
// back as the product's *errs.E.
func (j *Joiner) call(ctx context.Context, cfg *config.Config, req *agentv1.JoinRequest) (*agentv1.JoinResponse, error) {
	u, err := url.Parse(cfg.GatewayURL)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "gateway_url: not a URL")
	}
	serverName := cfg.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	tlsConfig, err := PinnedTLSConfig(cfg.ServingCASPKIPin, serverName, j.clock.Now)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "%v", err)
	}
	j.progress("joining through %s…", u.Host)
	client := agentv1connect.NewJoinServiceClient(j.httpClient(tlsConfig), cfg.GatewayURL,
		connect.WithGRPC(), connect.WithReadMaxBytes(maxResponseSize))
	ctx, cancel := context.WithTimeout(ctx, joinTimeout)
	defer cancel()
	res, err := client.Join(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, j.callError(err, u.Host)
	}
	return res.Msg, nil
}

// callError turns a failed Join call into the error the user reads.
func (j *Joiner) callError(err error, gateway string) error {
	// The pinned verification failed: the token never left this machine.
	var pe *pinError
	if errors.As(err, &pe) {
		return errs.New(errs.Unauthenticated, "refusing the gateway %s: %s; the token was not sent", gateway, pe.msg)
	}
	e, ok := errs.As(wire.FromWire(err))
	if !ok {
		return errs.New(errs.Unavailable, "cannot join through %s: %v", gateway, err)
	}
	switch e.Code {
	case errs.AccessDenied:
		// The agent never learns why (R4.7); say where the reason is.
		return errs.New(errs.AccessDenied, "%s (the reason is recorded by the control plane as a security.join.refused event; a refused join does not spend the token)", e.Message)
	case errs.Unavailable:
		return errs.New(errs.Unavailable, "cannot join through %s: %s", gateway, e.Message)
	}
	return e
}

// save writes the identity the verified body describes and returns it as
// Load reads it back.
func (j *Joiner) save(body *agentv1.JoinResponseBody, keyRecord []byte, attestor string) (*identity.Identity, error) {
	chainPEM := derToPEM(body.GetCertChain())
	bundlePEM := derToPEM(body.GetCommandBundle())
	id, err := identity.NewIdentity(chainPEM, attestor, j.clock.Now())
	if err != nil {
		return nil, err
	}
	// R12.3: commands of another generation are refused; from the signed
	// body, so the relay cannot change it.
	id.IdentityGeneration = body.GetIdentityGeneration()
	if err := j.cfg.Store.Save(id, keyRecord, chainPEM, bundlePEM); err != nil {
		return nil, fmt.Errorf("save the identity in %s: %w", j.cfg.Store.Dir, err)
	}
	saved, err := j.cfg.Store.Load()
	if err != nil {
		return nil, fmt.Errorf("reload the saved identity: %w", err)
	}
	return saved, nil
}

func derToPEM(ders [][]byte) []byte {
	var buf bytes.Buffer
	for _, d := range ders {
		_ = pem.Encode(&buf, &pem.Block{Type: "CERTIFICATE", Bytes: d})
	}
	return buf.Bytes()
}

// wireClaims converts the collected claims to the wire message.
func wireClaims(c hwid.Claims) *agentv1.Claims {
	return &agentv1.Claims{
		ProductUuid:   c.ProductUUID,
		ProductSerial: c.ProductSerial,
		BoardSerial:   c.BoardSerial,
		ChassisSerial: c.ChassisSerial,
		Macs:          c.MACs,
		GpuUuids:      c.GPUUUIDs,
		Hostname:      c.Hostname,
	}
}

func errText(err error) string {
	if e, ok := errs.As(err); ok {
		return e.Message
	}
	return err.Error()
}
