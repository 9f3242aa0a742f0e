// Package enroll is bcd's side of the join flow (R4.1–R4.3, R4.6, R4.9,
// R11.1–R11.4): it makes the node key and CSR, collects the hardware
// claims, builds the complete request and seals the join token to the
// pinned JoinService encryption key over the request's digest (or signs the
// digest, for x509pop), calls JoinService.Join through the gateway over TLS
// pinned to the serving CA, checks the signed answer in R4.6's order (verify.go),
// and saves the identity.
//
// A lost answer is recovered, never paid for twice (R4.9): the request is
// recorded in join.pending before it is first sent, sent again unchanged
// while failures are transient, and sent again by the next bcd join with
// the same token; JoinService answers a request it answered before with the
// stored answer. With --reset, the identity in place stays there, usable,
// until the new one is saved (identity.Store.Replace).
//
// It also implements the well-known fallback: with --server, the
// encryption key (when join-encryption.jwk is absent) and, on a host with no
// config.toml, the gateway come from the control plane's well-known
// document, and nothing in it is used unless it matches a pin.
//
// SECURITY: bcd's only trust anchors are the three pin sets (R16.2: each
// grows only through a statement a key of the set signed, config.Pins). The
// gateway is authenticated by the serving CA pins alone (PinnedTLSConfig;
// the one unverified dial, FetchKeyStatements, sends nothing and trusts
// nothing it gets back), the token is readable only by the holder of a
// pinned encryption key, and the answer is accepted only under a pinned
// join-signing key. Nothing but
// join.pending (the new key and the request, 0600, never the token) is
// written to the data directory until every check passed.
package enroll

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/claims"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/version"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Retries of one join request (R4.9).
const (
	// JoinAttempts bounds how often one bcd join sends its request when the
	// failures are transient.
	JoinAttempts = 5
	// JoinMinBackoff and JoinMaxBackoff bound the wait between attempts.
	JoinMinBackoff = 2 * time.Second
	JoinMaxBackoff = 30 * time.Second
)

const (
	// joinTimeout bounds one Join call, TLS handshake included.
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
	BCD *bcdconfig.Config
	// ConfigPath is config.toml's path (bcdconfig.DefaultPath when empty);
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
	// Sleep waits d between attempts, or until ctx ends (returning its
	// error); nil uses a timer. Tests move their clock instead.
	Sleep func(ctx context.Context, d time.Duration) error
	// Rand returns a number in [0, 1) for the retries' jitter; nil:
	// math/rand/v2.
	Rand func() float64
	// CallTimeout bounds one Join call; zero means two minutes.
	CallTimeout time.Duration
	// Pins are the live pin sets (R16.2), shared with bcd run's session
	// and renewer; nil: BCD's, persisted to ConfigPath.
	Pins *config.Pins
	// ServerTime is the control plane's clock as bcd knows it (R19.3): the
	// seal's iat and x509pop's client_time are dated by it, and every
	// answer corrects it. nil: one persisted in Store.Dir.
	ServerTime *servertime.Offset
}

// Joiner joins this machine; build it with New.
type Joiner struct {
	cfg         Config
	keys        identity.KeyStore
	clock       clock.Clock
	httpClient  HTTPClientFunc
	log         *slog.Logger
	sleep       func(ctx context.Context, d time.Duration) error
	rand        func() float64
	callTimeout time.Duration
	// waiting is set while a join waits on a join request: its repeated
	// sends say nothing (untilDecided says when it still waits).
	waiting bool
	// pins are the live pin sets; a host build (no config.toml yet) has
	// them in memory until it wrote one.
	pins *config.Pins
	// serverTime dates what the join stamps (Config.ServerTime).
	serverTime *servertime.Offset
}

// New returns a Joiner for cfg. cfg.Store is required.
func New(cfg Config) (*Joiner, error) {
	if cfg.Store == nil || cfg.Store.Dir == "" {
		return nil, errs.New(errs.InvalidConfig, "join: no data directory")
	}
	if cfg.ConfigPath == "" {
		cfg.ConfigPath = bcdconfig.DefaultPath
	}
	j := &Joiner{cfg: cfg, keys: cfg.Keys, clock: cfg.Clock, httpClient: cfg.HTTPClient, log: cfg.Log, sleep: cfg.Sleep, rand: cfg.Rand, callTimeout: cfg.CallTimeout}
	if j.sleep == nil {
		j.sleep = sleep
	}
	if j.rand == nil {
		j.rand = rand.Float64
	}
	if j.callTimeout <= 0 {
		j.callTimeout = joinTimeout
	}
	if j.keys == nil {
		j.keys = identity.SoftwareKeys{}
	}
	if j.clock == nil {
		j.clock = clock.Real{}
	}
	if j.serverTime = cfg.ServerTime; j.serverTime == nil {
		j.serverTime = servertime.New(servertime.Config{Dir: cfg.Store.Dir, Clock: j.clock})
	}
	if j.httpClient == nil {
		j.httpClient = DefaultHTTPClient
	}
	if j.log == nil {
		j.log = slog.New(slog.DiscardHandler)
	}
	j.pins = cfg.Pins
	if j.pins == nil && cfg.BCD != nil {
		j.pins = config.NewPins(cfg.ConfigPath, cfg.BCD, j.log)
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
	// ServerCAs, when set, are the CAs Server's TLS certificate must come
	// from (bcd join --server-ca-file). Nil: the chain is not checked, since
	// the document is trusted only through the pins.
	ServerCAs *x509.CertPool
	// Bootstrap is required when there is no config.toml (Config.BCD nil)
	// and refused otherwise.
	Bootstrap *Bootstrap
	// Boot is the network boot a site agent vouched for: the discovery
	// attestor's evidence (R10.4). Required with --attestor discovery.
	Boot *Boot
	// Reset joins although this machine has an identity (`bcd join --reset
	// --yes`, R11.4). The identity stays in place, and usable by bcd run,
	// until the new one is saved; then it is moved aside to
	// <data_dir>/reset-<time>/. A refused join leaves it as it was.
	Reset bool
}

// Boot is a ramdisk's network boot (R10.4), as its site's boot
// configuration gave it: the NIC it booted from, the address and the boot
// lease's epoch, and the provisioning workflow when one is named.
type Boot struct {
	MAC        string
	IP         string
	LeaseEpoch int64
	WorkflowID string
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
func (j *Joiner) claimsAndKey(cfg *bcdconfig.Config) (hwid.Claims, crypto.Signer, []byte, []byte, error) {
	j.progress("collecting hardware claims…")
	cl, warnings, err := claims.Collect(cfg.SysfsRoot, cfg.ProcfsRoot)
	for _, w := range warnings {
		j.log.Warn("hardware claim", telemetry.LogWarning, w)
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

// Reset moves the identity aside (`bcd join --reset --yes` without a token,
// R11.4) and returns the directory that now holds it. It returns an error
// matching identity.ErrNotJoined when there is no identity. A reset with a
// token is Join with Options.Reset, which keeps the identity in place until
// the new one is saved.
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
		if opts.Reset {
			return nil, errs.New(errs.InvalidArgument,
				"--attestor x509pop re-joins with the expired identity, so it cannot be reset first; bcd moves it aside itself once the control plane answered")
		}
		return j.rejoin(ctx, opts)
	}
	if wireAttestor == identity.AttestorTPM {
		return j.tpmJoin(ctx, opts, role)
	}
	// R11.4: with --reset the identity in place (even a damaged one) stays
	// there, and usable, until the new one is saved.
	var old *oldIdentity
	if opts.Reset {
		if old, err = j.oldIdentity(); err != nil {
			return nil, err
		}
	} else if err := j.refuseJoined(); err != nil {
		return nil, err
	}

	cfg, wk, err := j.joinConfig(ctx, opts)
	if err != nil {
		return nil, err
	}

	encKey, wk, err := j.encryptionKey(ctx, cfg, opts.wellKnownSource(), wk)
	if err != nil {
		return nil, err
	}

	p, err := j.pendingRequest(cfg, opts, old, role, wireAttestor)
	if err != nil {
		return nil, err
	}
	req := p.req

	// R4.2: the seal covers the digest of the complete request. Each
	// attempt seals anew, so iat stays fresh; the digest does not cover the
	// seal, so the request stays the same.
	j.progress("sealing the token…")
	reseal := func(r *agentv1.JoinRequest) error {
		sealed, err := pki.Seal(encKey, opts.Token, r.GetCsr(), pki.JoinRequestDigest(r), j.serverTime.StampNow())
		if err != nil {
			return fmt.Errorf("seal the token: %w", err)
		}
		r.SealedToken = sealed
		return nil
	}
	var docCert *x509.Certificate
	if wk != nil {
		docCert = wk.signingCert
	}
	want2 := expectation{
		liveRetired:   func() []string { return cfg.RetiredPins },
		livePins:      cfg.JoinSigningPins,
		docCert:       docCert,
		csrHash:       pki.CSRHash(req.GetCsr()),
		nodeKey:       p.signer.Public(),
		siteID:        cfg.Site,
		nodeID:        opts.NodeID,
		role:          role,
		allowDeferral: true,
	}
	body, err := j.sendUntilDecided(ctx, cfg, req, reseal, want2)
	if err != nil {
		if old != nil && errs.CodeOf(err) == errs.AccessDenied {
			return nil, old.refused(err, reclaimByToken)
		}
		return nil, err
	}

	id, aside, err := j.install(body, p.keyRecord, opts.Attestor, opts.Reset)
	if err != nil {
		return nil, err
	}
	if aside != "" {
		j.progress("moved the old identity aside to %s", aside)
	}
	if j.cfg.BCD == nil {
		if err := j.writeConfig(cfg, encKey, opts.Bootstrap); err != nil {
			return id, err
		}
		j.pins = config.NewPins(j.cfg.ConfigPath, cfg, j.log)
	}
	j.learnAnswer("join answer", body)
	return id, nil
}

// learn applies the key statements of a verified answer or document to the
// live pin sets and config.toml (R16.2). A failure to save is logged (by
// Pins.Learn) and never fails the join: its identity is saved.
func (j *Joiner) learn(source string, statements []string) {
	if j.pins != nil {
		_, _ = j.pins.Learn(source, statements)
	}
}

// learnAnswer learns the keys and the control plane's time of a verified
// answer. R19.3: the body is signed, so its time is the control plane's;
// a stored answer replayed for a retry carries the time of its first
// answer, which the next session's Welcome corrects.
func (j *Joiner) learnAnswer(source string, body *agentv1.JoinResponseBody) {
	j.learn(source, body.GetKeyStatements())
	j.learnTime(source, body.GetServerTimeUnixMs())
}

// learnTime corrects the offset from the control plane's time serverMs;
// a failure is logged and never fails the join.
func (j *Joiner) learnTime(source string, serverMs int64) {
	if _, err := j.serverTime.Learn(serverMs); err != nil && j.log != nil {
		j.log.Warn("not correcting for the control plane's time", telemetry.LogSource, source, telemetry.LogErr, err)
	}
}

// clockRetry reports whether a refused join is worth sending once more
// with the clock corrected (R19.3): the refusal does not say why (R4.7),
// so bcd asks the gateway for the control plane's time (an unsigned hint)
// and retries when it moved what the retry is dated by more than
// retryClockMove. The hint dates the retry only (servertime.Hint, R21.4).
func (j *Joiner) clockRetry(ctx context.Context, gatewayURL, serverName string) bool {
	ms, err := FetchServerTime(ctx, j.httpClient, gatewayURL, serverName)
	if err != nil || ms == 0 {
		return false
	}
	return j.serverTime.Hint(ms, retryClockMove)
}

// retryClockMove is how far a learned offset must move before a refused
// join or renewal is sent again: less cannot have caused the refusal.
const retryClockMove = 30 * time.Second

// joinConfig is the configuration a token join uses: config.toml, or one
// built from the well-known document (R11.3), with that document.
func (j *Joiner) joinConfig(ctx context.Context, opts Options) (*bcdconfig.Config, *wellKnown, error) {
	if j.cfg.BCD == nil {
		return j.buildConfig(ctx, opts)
	}
	if opts.Bootstrap != nil {
		return nil, nil, errs.New(errs.InvalidArgument,
			"%s exists: --site and the pin flags only build a configuration on a host without one", j.cfg.ConfigPath)
	}
	c := *j.cfg.BCD
	c.ApplyDefaults()
	syncPins(&c, j.pins)
	if err := c.Validate(); err != nil {
		return nil, nil, err
	}
	return &c, nil, nil
}

// pendingRequest is the request a token join sends (R4.9): the one of an
// earlier run that got no answer, when it was for this token, or a new one,
// recorded before it is first sent.
func (j *Joiner) pendingRequest(cfg *bcdconfig.Config, opts Options, old *oldIdentity, role, wireAttestor string) (*pending, error) {
	want := pendingKey{tokenSHA256: TokenHash(opts.Token), attestor: wireAttestor, role: role, nodeID: opts.NodeID, site: cfg.Site}
	evidence, err := bootEvidence(opts.Boot)
	if err != nil {
		return nil, err
	}
	p := j.takePending(want, old.identity(), func(r *agentv1.JoinRequest) bool {
		// Another boot (a new lease) is another request.
		return bytes.Equal(r.GetEvidence(), evidence)
	})
	if p != nil {
		j.progress("sending the request of an earlier join that got no answer (%s) again…", j.pendingPath())
		return p, nil
	}
	cl, signer, keyRecord, csr, err := j.claimsAndKey(cfg)
	if err != nil {
		return nil, err
	}
	p = &pending{signer: signer, keyRecord: keyRecord, req: &agentv1.JoinRequest{
		Csr:      csr,
		Claims:   wireClaims(cl),
		Attestor: wireAttestor,
		Role:     role,
		NodeId:   opts.NodeID,
		Protocol: version.ProtocolMax,
		Evidence: evidence,
	}}
	if err := j.writePending(p, want.tokenSHA256, cfg.Site); err != nil {
		return nil, err
	}
	return p, nil
}

// sendFailed is the error of a failed send. A definite answer means the
// request did not land: join.pending goes. Otherwise it stays, and an
// UNAVAILABLE says how to pick up an answer that may have landed.
func (j *Joiner) sendFailed(err error, answered bool, again string) error {
	if answered {
		j.removePending()
		return err
	}
	if e, ok := errs.As(err); ok && e.Code == errs.Unavailable {
		return errs.New(errs.Unavailable, "%s; the request is kept in %s: if it reached the control plane, run %s to pick up its answer",
			e.Message, j.pendingPath(), again)
	}
	return err
}

// oldIdentity is what is in the data directory before a join with --reset.
type oldIdentity struct {
	// id is the identity when it loads (an expired one too), else nil.
	id  *identity.Identity
	dir string
}

func (o *oldIdentity) identity() *identity.Identity {
	if o == nil {
		return nil
	}
	return o.id
}

// oldIdentity returns what a join with --reset will replace: nil when the
// data directory holds no identity file.
func (j *Joiner) oldIdentity() (*oldIdentity, error) {
	present, err := j.cfg.Store.Present()
	if err != nil {
		return nil, err
	}
	if len(present) == 0 {
		j.progress("nothing to reset: no identity in %s", j.cfg.Store.Dir)
		return nil, nil
	}
	old := &oldIdentity{dir: j.cfg.Store.Dir}
	if id, err := j.cfg.Store.Load(); err == nil {
		old.id = id
	}
	return old, nil
}

// The step that lets a known machine join with a new key, by attestor: a
// token's flag, or a tpm pool's policy (a tpm join takes no token).
const (
	reclaimByToken = "unless the token allows it: mint a token with --allow-reclaim and run bcd join --reset --yes again"
	reclaimByTPM   = "unless its pool allows it: an operator sets allow_reclaim = true in the pool's [[join.tpm.pools]] entry (or retires the old node), then run bcd join --reset --yes --attestor tpm again"
)

// refused is the answer to a refused join with --reset: the old identity
// stayed, and the usual cause is a machine the control plane knows;
// reclaim is the step that lets it in (reclaimByToken, reclaimByTPM).
func (o *oldIdentity) refused(err error, reclaim string) error {
	// The control plane's uniform message (and a clock note), without the
	// general note on where the reason is: said below.
	msg := strings.Replace(errs.MessageOf(err), refusedNote, "", 1)
	kept := "The old identity was kept in place in " + o.dir
	if o.id != nil {
		kept = fmt.Sprintf("The old identity (node %s) was kept in place", o.id.NodeID)
	}
	return errs.New(errs.AccessDenied,
		"%s. This machine has joined before; the control plane refuses a new key for a known machine %s. The reason is recorded in the security.join.refused event. %s.",
		strings.TrimSuffix(msg, "."), reclaim, kept)
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
	case identity.AttestorDiscovery:
		// R10.4: a ramdisk the site booted, with the site's ramdisk token.
		if role != pki.RoleRamdisk {
			return "", "", errs.Invalid("--role", "--attestor discovery joins a ramdisk: use --role ramdisk")
		}
		if b := opts.Boot; b == nil || b.MAC == "" || b.IP == "" || b.LeaseEpoch <= 0 {
			return "", "", errs.New(errs.InvalidArgument, "--attestor discovery needs the boot the site agent vouched for: --boot-mac, --boot-ip and --boot-lease-epoch")
		}
		attestor = identity.AttestorDiscovery
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
	case identity.AttestorTPM:
		// R9.2: the TPM is the evidence; no token.
		if opts.Token != "" {
			return "", "", errs.New(errs.InvalidArgument, "--attestor tpm takes no join token: the machine's TPM proves it instead")
		}
		if role != pki.RoleNode {
			// R15.2: the control plane refuses any other role for a tpm
			// join; site and ramdisk come only from their modules' tokens.
			return "", "", errs.Invalid("--role", "--attestor tpm joins a node: leave --role out (site and ramdisk roles come only with their tokens)")
		}
		return role, identity.AttestorTPM, nil
	default:
		return "", "", errs.Invalid("--attestor", "this bcd joins with a join token (attestor %s; leave --attestor out), with its TPM and no token with %s, as a ramdisk its site booted with %s, or re-joins after its certificate expired with %s",
			identity.AttestorJoinToken, identity.AttestorTPM, identity.AttestorDiscovery, identity.AttestorX509Pop)
	}
	if opts.Boot != nil && attestor != identity.AttestorDiscovery {
		return "", "", errs.New(errs.InvalidArgument, "--boot-mac, --boot-ip, --boot-lease-epoch and --workflow-id are the discovery attestor's evidence: add --attestor discovery")
	}
	if opts.Token == "" {
		return "", "", errs.New(errs.InvalidArgument, "no join token: pipe it on standard input (bcd join < join-token), or use BCD_JOIN_TOKEN or --token-file")
	}
	if opts.NodeID != "" && !ids.Valid(ids.Node, opts.NodeID) {
		return "", "", errs.Invalid("--node-id", "want a node id like node_01k5w…")
	}
	return role, attestor, nil
}

// refuseJoined answers "already joined" when an identity loads (an expired
// one too: bcd keeps it, R11.4), and passes on a damaged identity's
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
func (j *Joiner) buildConfig(ctx context.Context, opts Options) (*bcdconfig.Config, *wellKnown, error) {
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

	c := &bcdconfig.Config{
		Site:                 b.Site,
		ServingCASPKIPin:     b.ServingCAPin,
		JoinSigningKeyPin:    b.JoinSigningPin,
		JoinEncryptionKeyPin: b.JoinEncryptionPin,
		DataDir:              b.DataDir,
		SysfsRoot:            b.SysfsRoot,
		ProcfsRoot:           b.ProcfsRoot,
	}
	wk, err := j.fetchWellKnown(ctx, opts.wellKnownSource(), c)
	if err != nil {
		return nil, nil, err
	}
	// The document's statements that the flags' keys vouch for (R16.2):
	// an install script older than a rotation still builds.
	c = wk.pins
	g := wk.doc.Gateway
	if g == nil || g.URL == "" {
		return nil, nil, errs.New(errs.InvalidConfig, "%s has no gateway section: the control plane's options do not name a gateway (gateway: { url })", wk.url)
	}
	// SECURITY: the document only says where; the pins say who.
	var differ []string
	if !slices.Contains(c.ServingCAPins(), g.ServingCAPin) {
		differ = append(differ, "gateway.servingCaPin differs from --serving-ca-pin")
	}
	if !slices.Contains(c.JoinSigningPins(), wk.doc.Join.SigningKeyPin) {
		differ = append(differ, "join.signingKeyPin differs from --join-signing-pin")
	}
	if !slices.Contains(c.JoinEncryptionPins(), wk.doc.Join.EncryptionKeyPin) {
		differ = append(differ, "join.encryptionKeyPin differs from --join-encryption-pin")
	}
	if len(differ) > 0 {
		return nil, nil, errs.New(errs.InvalidConfig,
			"refusing the well-known document at %s: %v; it belongs to another PKI, or the pins of this install are stale", wk.url, differ)
	}
	c.GatewayURL, c.GatewayServerName = g.URL, g.ServerName
	c.ApplyDefaults()
	j.pins = config.NewPins("", c, j.log)
	if err := c.Validate(); err != nil {
		e, _ := errs.As(err)
		return nil, nil, errs.New(errs.InvalidConfig, "the configuration built from %s and the flags is not valid: %s", wk.url, e.Message)
	}
	return c, wk, nil
}

// writeConfig writes join-encryption.jwk, then config.toml, after a host
// build's join (R11.3). config.toml last: its presence means the install
// is complete.
func (j *Joiner) writeConfig(cfg *bcdconfig.Config, encKey *ecdsa.PublicKey, b *Bootstrap) error {
	dir := filepath.Dir(j.cfg.ConfigPath)
	out := *cfg
	// Keep defaults out of the file, so a later bcd with other defaults
	// is not pinned to these.
	out.DataDir, out.SysfsRoot, out.ProcfsRoot, out.TPM = b.DataDir, b.SysfsRoot, b.ProcfsRoot, bcdconfig.TPM{}
	fail := func(err error) error {
		return errs.New(errs.InvalidState, "joined, but could not write the configuration in %s: %s; the daemon cannot start without it: write it by hand (the install script's config.toml), or run bcd join --reset --yes and join again with a new token",
			dir, errs.MessageOf(err))
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fail(err)
	}
	encPin, err := pki.Pin(encKey)
	if err != nil {
		return fail(err)
	}
	if err := bcdconfig.WriteEncryptionKey(dir, encPin, encKey); err != nil {
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
func (j *Joiner) encryptionKey(ctx context.Context, cfg *bcdconfig.Config, server source, wk *wellKnown) (*ecdsa.PublicKey, *wellKnown, error) {
	dir := filepath.Dir(j.cfg.ConfigPath)
	key, _, found, err := bcdconfig.LoadEncryptionKeySet(dir, cfg.JoinEncryptionPins())
	if err != nil {
		return nil, wk, err
	}
	if found {
		return key, wk, nil
	}
	if wk == nil {
		if server.url == "" {
			return nil, nil, errs.New(errs.InvalidConfig,
				"no JoinService encryption key: %s is missing; install it (the install script writes it), or pass --server with the control plane's URL to fetch it from its well-known document",
				filepath.Join(dir, bcdconfig.EncryptionKeyFile))
		}
		if wk, err = j.fetchWellKnown(ctx, server, cfg); err != nil {
			return nil, nil, err
		}
		if wk.learned.Changed() {
			j.learn("well-known", wk.doc.Join.KeyStatements)
			syncPins(cfg, j.pins)
		}
	}
	return wk.encKey, wk, nil
}

// send dials the gateway over pinned TLS and sends req with Join, again and
// again while the failure is transient (R4.9): a deadline, an unavailable
// gateway (HTTP 502, 503, 504), a reset connection. Every attempt sends the
// very same request, so when an earlier one landed and only its answer was
// lost, JoinService answers with what it stored for it and spends nothing.
// reseal, when set, seals the token anew before each attempt (a fresh iat;
// the seal is not part of the request's digest). A definite answer
// (ACCESS_DENIED, CONFLICT, ...) is never retried.
//
// answered reports whether the control plane gave a definite answer, so the
// request did not land (and join.pending can go); on a transient failure
// or a refused gateway it is false.
func (j *Joiner) send(ctx context.Context, cfg *bcdconfig.Config, req *agentv1.JoinRequest, reseal func(*agentv1.JoinRequest) error) (res *agentv1.JoinResponse, answered bool, err error) {
	u, err := url.Parse(cfg.GatewayURL)
	if err != nil {
		return nil, false, errs.New(errs.InvalidConfig, "gateway_url: not a URL")
	}
	serverName := cfg.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	newClient := func() (agentv1connect.JoinServiceClient, error) {
		tlsConfig, err := PinnedTLSConfig(cfg.ServingCAPins(), serverName, j.clock.Now)
		if err != nil {
			return nil, errs.Wrap(err, errs.InvalidConfig, "%v", err)
		}
		return agentv1connect.NewJoinServiceClient(j.httpClient(tlsConfig), cfg.GatewayURL,
			connect.WithGRPC(), connect.WithReadMaxBytes(maxResponseSize)), nil
	}
	if !j.waiting {
		j.progress("joining through %s…", u.Host)
		if req.GetAttestor() == identity.AttestorDiscovery {
			// The control plane holds the answer until this site's agent
			// vouches for the boot: say so before the silence.
			j.progress("asking the control plane; a discovery join waits up to its [join] vouch_wait (8s by default) for this site's vouch")
		}
	}
	// One client for every attempt: its connection is reused.
	client, err := newClient()
	if err != nil {
		return nil, false, err
	}
	recovered, clockRetried := false, false
	for attempt := 1; ; attempt++ {
		if reseal != nil {
			if err := reseal(req); err != nil {
				return nil, false, err
			}
		}
		callCtx, cancel := context.WithTimeout(ctx, j.callTimeout)
		r, err := client.Join(callCtx, connect.NewRequest(req))
		cancel()
		if err == nil {
			return r.Msg, true, nil
		}
		// R16.2: a gateway on a serving CA rotated while this machine was
		// offline; once per send, and only with a CA a pinned key vouched
		// for.
		if isPinError(err) && !recovered && ctx.Err() == nil {
			recovered = true
			if RecoverPins(ctx, j.pins, j.httpClient, cfg.GatewayURL, serverName, j.log) {
				syncPins(cfg, j.pins)
				if client, err = newClient(); err != nil {
					return nil, false, err
				}
				attempt--
				continue
			}
		}
		out, transient := j.callError(err, u.Host)
		// R19.3: a refusal for this machine's clock; once per send, and
		// only for a request that is dated anew (reseal).
		if e, ok := errs.As(out); ok && e.Code == errs.AccessDenied && reseal != nil && !clockRetried && ctx.Err() == nil {
			clockRetried = true
			if j.clockRetry(ctx, cfg.GatewayURL, serverName) {
				j.progress("refused with this machine's clock off the control plane's; sending it again dated by the control plane's clock…")
				attempt--
				continue
			}
		}
		if !transient || ctx.Err() != nil {
			return nil, !transient && !isPinError(err), out
		}
		if attempt >= JoinAttempts {
			return nil, false, out
		}
		wait := backoff.Policy{Min: JoinMinBackoff, Max: JoinMaxBackoff, Jitter: backoff.DefaultJitter}.Spread(attempt, j.rand())
		j.progress("no answer through %s (%s); sending the same request again in %s (attempt %d of %d)…",
			u.Host, errs.MessageOf(out), wait, attempt+1, JoinAttempts)
		if err := j.sleep(ctx, wait); err != nil {
			return nil, false, errs.Wrap(err, errs.Unavailable, "cannot join through %s: stopped while waiting to retry: %v", u.Host, err)
		}
	}
}

// JoinBackoff is the wait after the n-th failed attempt (n ≥ 1):
// JoinMinBackoff doubling up to JoinMaxBackoff, before the join spreads it
// by ±20% (backoff.DefaultJitter) so a rack that booted together does not
// retry in lockstep.
func JoinBackoff(n int) time.Duration {
	return backoff.Policy{Min: JoinMinBackoff, Max: JoinMaxBackoff}.Delay(n)
}

func isPinError(err error) bool {
	var pe *pinError
	return errors.As(err, &pe)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// callError turns a failed Join call into the error the user reads, and
// reports whether it is transient: UNAVAILABLE, which is what a deadline, a
// reset connection, an HTTP 502, 503 or 504 from the gateway, or an answer
// without a product code come back as (wire.FromWire). Everything the
// control plane answered with a product code but UNAVAILABLE is definite.
func (j *Joiner) callError(err error, gateway string) (out error, transient bool) {
	// The pinned verification failed: the token never left this machine.
	var pe *pinError
	if errors.As(err, &pe) {
		return errs.New(errs.Unauthenticated, "refusing the gateway %s: %s; the token was not sent", gateway, pe.msg), false
	}
	e, ok := errs.As(wire.FromWire(err))
	if !ok {
		return errs.Wrap(err, errs.Unavailable, "cannot join through %s: %v", gateway, err), true
	}
	switch e.Code {
	case errs.AccessDenied:
		// The agent never learns why (R4.7); say where the reason is, and
		// what this machine can see itself: a clock off the gateway's.
		return errs.New(errs.AccessDenied, "%s%s%s", e.Message, refusedNote, j.clockNote(err)), false
	case errs.Unavailable:
		return errs.New(errs.Unavailable, "cannot join through %s: %s", gateway, e.Message), true
	}
	return e, false
}

// refusedNote follows the control plane's uniform refusal.
const refusedNote = " (the reason is recorded by the control plane as a security.join.refused event; a refused join does not spend the token)"

// maxClockSkew is how far this machine's clock may be from the gateway's
// before a refusal mentions it: the seal's iat is refused more than
// pki.SealMaxFuture ahead of the control plane's clock (R4.2).
const maxClockSkew = time.Minute

// clockNote returns a note for a refused join when the gateway's Date header
// shows this machine's clock more than maxClockSkew off, else "". The
// header is only a hint for the operator (the gateway is not trusted):
// it never changes what bcd does.
func (j *Joiner) clockNote(err error) string {
	// R19.3: the offset learned from the control plane (the Keys answer
	// on a refusal) names the clock when it is off.
	if off, learned := j.serverTime.Offset(); !learned.IsZero() && (off > maxClockSkew || off < -maxClockSkew) {
		return "; " + servertime.Describe(off)
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return ""
	}
	date, perr := http.ParseTime(ce.Meta().Get("Date"))
	if perr != nil {
		return ""
	}
	skew := j.clock.Now().Sub(date).Truncate(time.Second)
	switch {
	case skew > maxClockSkew:
		return fmt.Sprintf("; this machine's clock is %s ahead of the gateway's, and a seal dated more than %s ahead of the control plane's clock is refused: set the clock (NTP) and join again", skew, pki.SealMaxFuture)
	case skew < -maxClockSkew:
		return fmt.Sprintf("; this machine's clock is %s behind the gateway's, and a seal older than %s by the control plane's clock is refused: set the clock (NTP) and join again", -skew, pki.SealMaxAge)
	}
	return ""
}

// install saves the identity the verified body describes and returns it as
// Load reads it back. With replace, an identity in place is replaced in one
// step and kept aside (identity.Store.Replace); aside is its directory. Once
// the identity is saved, join.pending has done its work and goes.
func (j *Joiner) install(body *agentv1.JoinResponseBody, keyRecord []byte, attestor string, replace bool) (saved *identity.Identity, aside string, err error) {
	chainPEM := pki.ChainPEM(body.GetCertChain())
	bundlePEM := pki.ChainPEM(body.GetCommandBundle())
	id, err := identity.NewIdentity(chainPEM, attestor, j.clock.Now())
	if err != nil {
		return nil, "", err
	}
	// R12.3: commands of another generation are refused; from the signed
	// body, so the relay cannot change it.
	id.IdentityGeneration = body.GetIdentityGeneration()
	if replace {
		aside, err = j.cfg.Store.Replace(j.clock.Now(), id, keyRecord, chainPEM, bundlePEM)
	} else {
		err = j.cfg.Store.Save(id, keyRecord, chainPEM, bundlePEM)
	}
	if err != nil {
		return nil, "", fmt.Errorf("save the identity in %s: %w", j.cfg.Store.Dir, err)
	}
	j.removePending()
	saved, err = j.cfg.Store.Load()
	if err != nil {
		return nil, aside, fmt.Errorf("reload the saved identity: %w", err)
	}
	return saved, aside, nil
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
