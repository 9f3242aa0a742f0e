// Package renew is bcd's side of certificate renewal (R13.1): at about 60%
// of its certificate's lifetime the node makes a new key and CSR, proves
// possession of its current key (pop_sig, purpose renew-pop), calls
// JoinService.Renew through the gateway over TLS pinned to the serving CA
// and presenting its current certificate as TLS client certificate, checks
// the signed answer exactly like a join answer, and saves the new identity
// in one step.
//
// SECURITY: the answer is accepted only under the pinned join-signing key,
// for the new key, the same node, site, trust domain and role. Nothing is
// written before every check passed, and a failed renewal keeps the current
// identity. A certificate naming a TPM attestation key is never renewed
// without the TPM's attestation (R13.3): the AK certifies the next key, made
// in the TPM, and when the TPM is gone or derives another AK bcd fails
// loudly without sending anything.
package renew

import (
	"bytes"
	"context"
	"crypto"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/url"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Renewal timing (R13.1). Each renewal is due at a point drawn uniformly
// from RenewAtPercent ± JitterPercent of the lifetime: 45% to 75%.
//
//   - The mean stays at 60%, what R13.1 asks ("about 60%"), so a fleet
//     renews as often as before: once per 0.6 lifetimes per node on
//     average, whatever the spread. The window is symmetric around it.
//   - The latest due time, 75%, leaves a quarter of the lifetime (6 h of
//     day-long certificates, 75 s of 5-minute ones) for the retries of a
//     renewal that failed (Backoff, at most 5 minutes apart, and never
//     past the expiry: retryWait). A quarter is also the most bcd run's
//     session keeps clear of the expiry (it opens no session on a
//     certificate that expires before the next heartbeat, and never
//     holds back longer than a quarter of the lifetime): a renewal is
//     always due before the session would wait for it.
//   - So the window is 30% of the lifetime wide (it was 10%): machines
//     that joined or restarted within a minute of each other, a rack or
//     a region, renew over 7.2 hours with day-long certificates (90 s
//     with 5-minute ones) instead of 2.4 hours (30 s), a third of the
//     peak rate of renewals and of the sessions reopened after them.
//     Each later renewal draws again, so the wave keeps spreading.
const (
	// RenewAtPercent is the mean share of the lifetime after which the
	// node renews.
	RenewAtPercent = 60
	// JitterPercent spreads renewals uniformly by up to this share of the
	// lifetime either way, so a fleet joined at once does not renew at
	// once.
	JitterPercent = 15
	// MinBackoff and MaxBackoff bound the wait between failed attempts.
	MinBackoff = time.Second
	MaxBackoff = 5 * time.Minute

	// renewTimeout bounds one Renew call, TLS handshake included.
	renewTimeout = 2 * time.Minute
	// maxResponseSize bounds the answer; a real one is a few KiB.
	maxResponseSize = 1 << 20
)

// Config lists a Renewer's dependencies.
type Config struct {
	// BCD is the loaded configuration (gateway and pins); required.
	BCD *bcdconfig.Config
	// Store is the identity's data directory; required.
	Store *identity.Store
	// Keys makes the new node key; nil means identity.SoftwareKeys.
	Keys identity.KeyStore
	// Clock is the time source; nil means the wall clock.
	Clock clock.Clock
	// HTTPClient makes the gateway's HTTP client from the pinned TLS
	// configuration; nil means enroll.DefaultHTTPClient.
	HTTPClient enroll.HTTPClientFunc
	// Log receives a line per renewal and per failure; nil discards.
	Log *slog.Logger
	// Rand returns a number in [0, 1) for the jitter; nil means
	// math/rand/v2.
	Rand func() float64
	// Sleep waits d or until ctx ends (returning its error); nil uses a
	// timer of Clock.
	Sleep func(ctx context.Context, d time.Duration) error
	// OnRenewed, when set, is called after each renewal Loop saved (bcd
	// run's session then reconnects with the new certificate at once,
	// R19.3).
	OnRenewed func(*identity.Identity)
	// OnFailed, when set, is called after each renewal Loop tried and
	// could not make (bcd's diagnostics: the node is not ready, R17.2).
	OnFailed func(error)
	// Pins are the live pin sets (R16.2), shared with bcd run's session;
	// nil: BCD's, kept in memory only (bcd passes config.NewPins with
	// config.toml's path, so what a renewal learns is saved).
	Pins *config.Pins
	// Tickets, when set, resumes the gateway's TLS sessions of the
	// current identity (shared with bcd run's session, which leaves a
	// ticket; enroll.TicketCache).
	Tickets *enroll.TicketCache
	// ServerTime is the control plane's clock as bcd knows it (R19.3):
	// client_time and the certificate's expiry are read by it, and every
	// renewal answer corrects it. nil: one persisted in Store.Dir.
	ServerTime *servertime.Offset
	// Session, when set, is bcd run's session connection: a renewal of
	// the certificate the session is welcomed on is sent over it, with no
	// TLS handshake of its own (session.go). nil, or no session on the
	// certificate: a connection of the renewal's own.
	Session *SessionConn
}

// Renewer renews this node's certificate; build it with New.
type Renewer struct {
	cfg   Config
	bcd   bcdconfig.Config
	keys  identity.KeyStore
	clock clock.Clock
	hc    enroll.HTTPClientFunc
	log   *slog.Logger
	rand  func() float64
	sleep func(ctx context.Context, d time.Duration) error
	pins  *config.Pins
	// serverTime dates client_time and reads expiry (Config.ServerTime).
	serverTime *servertime.Offset
	// pending is the next key and its CSR, kept until a renewal from
	// the same certificate is saved (nextKey).
	mu      sync.Mutex
	pending *pendingKey
	// retryWait is the wait before the next attempt after a failure
	// (Loop's own).
	retryWait time.Duration
}

// pendingKey is a next key made for renewing the certificate parent.
type pendingKey struct {
	parent string
	signer crypto.Signer
	record []byte
	csr    []byte
}

// nextKey returns the next node key, its key file record and its CSR. A
// renewal from the same certificate sends the same CSR again until one is
// saved (R21.1): when an answer was lost, or came signed by a key bcd
// could not check yet, the control plane has already issued the
// certificate and superseded the current one, and answers the same CSR
// again with that certificate, where a new key would be refused.
func (r *Renewer) nextKey(id *identity.Identity) (crypto.Signer, []byte, []byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.pending; p != nil && p.parent == id.Serial {
		return p.signer, p.record, p.csr, nil
	}
	signer, record, err := r.keys.GenerateKey()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("make the next node key: %w", err)
	}
	csr, err := identity.NewCSR(signer, id.NodeID)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("make the certificate request: %w", err)
	}
	r.pending = &pendingKey{parent: id.Serial, signer: signer, record: record, csr: csr}
	return signer, record, csr, nil
}

// New returns a Renewer for cfg. Errors are INVALID_CONFIG.
func New(cfg Config) (*Renewer, error) {
	if cfg.BCD == nil {
		return nil, errs.New(errs.InvalidConfig, "renew: no bcd configuration (config.toml): the gateway and the pins come from it")
	}
	if cfg.Store == nil || cfg.Store.Dir == "" {
		return nil, errs.New(errs.InvalidConfig, "renew: no data directory")
	}
	c := *cfg.BCD
	c.ApplyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	r := &Renewer{cfg: cfg, bcd: c, keys: cfg.Keys, clock: cfg.Clock, hc: cfg.HTTPClient, log: cfg.Log, rand: cfg.Rand, sleep: cfg.Sleep}
	if r.keys == nil {
		r.keys = identity.SoftwareKeys{}
	}
	if r.clock == nil {
		r.clock = clock.Real{}
	}
	if r.hc == nil {
		r.hc = enroll.DefaultHTTPClient
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	if r.rand == nil {
		r.rand = rand.Float64
	}
	if r.sleep == nil {
		r.sleep = r.clockSleep
	}
	if r.serverTime = cfg.ServerTime; r.serverTime == nil {
		r.serverTime = servertime.New(servertime.Config{Dir: cfg.Store.Dir, Clock: r.clock})
	}
	r.pins = cfg.Pins
	if r.pins == nil {
		r.pins = config.NewPins("", &c, r.log)
	}
	return r, nil
}

// clockSleep waits d on the Renewer's clock, so tests move time.
func (r *Renewer) clockSleep(ctx context.Context, d time.Duration) error {
	clock.Sleep(r.clock, ctx.Done(), d)
	return ctx.Err()
}

// NextRenewal returns when id's certificate should be renewed: NotBefore
// plus 60% of its lifetime, moved by a random jitter drawn uniformly from
// ±15% of the lifetime (45% to 75%).
func (r *Renewer) NextRenewal(id *identity.Identity) time.Time {
	leaf := id.Leaf()
	if leaf == nil {
		return r.serverTime.Now()
	}
	return DueAt(leaf.NotBefore, leaf.NotAfter, r.rand())
}

// DueAt is when a certificate valid from notBefore to notAfter is due
// for renewal, for r in [0, 1): RenewAtPercent of its lifetime moved by
// up to JitterPercent either way, r = 0.5 being the mean (45% to 75%).
func DueAt(notBefore, notAfter time.Time, r float64) time.Time {
	life := notAfter.Sub(notBefore)
	jitter := time.Duration((2*r - 1) * float64(life*JitterPercent/100))
	return notBefore.Add(life*RenewAtPercent/100 + jitter)
}

// Backoff is the wait after the n-th failed attempt in a row (n ≥ 1):
// MinBackoff doubling up to MaxBackoff, before Loop spreads it by ±20%
// (backoff.DefaultJitter).
func Backoff(n int) time.Duration { return backoff.Policy{Min: MinBackoff, Max: MaxBackoff}.Delay(n) }

// Loop renews the certificate whenever it is due, until ctx ends: it
// sleeps until NextRenewal, renews, and after a failure retries with
// exponential backoff (1 s to 5 min, ±20%, never past the expiry:
// retryIn). It returns ctx's error when ctx
// ends, and an error without retrying when there is no usable identity
// (not joined, damaged, or expired: a renewal can no longer succeed, and
// the error says how to join again).
func (r *Renewer) Loop(ctx context.Context) error {
	failures := 0
	for {
		id, err := r.load()
		if err != nil {
			return err
		}
		wait := r.NextRenewal(id).Sub(r.serverTime.Now())
		if failures > 0 {
			wait = r.retryIn(id)
		}
		// Only these outlive the wait: the parsed identity is not kept
		// for the hours until the renewal (RenewOnce loads it again).
		nodeID, serial := id.NodeID, id.Serial
		if err := r.sleep(ctx, wait); err != nil {
			return err
		}
		renewed, err := r.RenewOnce(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			failures++
			// Spread, so a fleet that failed at once (its gateway was
			// down) does not come back in lockstep.
			r.retryWait = backoff.Policy{Min: MinBackoff, Max: MaxBackoff, Jitter: backoff.DefaultJitter}.Spread(failures, r.rand())
			r.log.Warn("certificate renewal failed", telemetry.LogNodeID, nodeID, telemetry.LogAttempt, failures, telemetry.LogRetryIn, r.retryWait.Round(time.Millisecond).String(), telemetry.LogErr, err)
			if r.cfg.OnFailed != nil {
				r.cfg.OnFailed(err)
			}
			if e, ok := errs.As(err); ok && e.Code == errs.InvalidState {
				// The identity cannot be renewed (expired, a TPM key
				// this bcd cannot attest): retrying will not help.
				return err
			}
			continue
		}
		failures = 0
		r.log.Info("certificate renewed", telemetry.LogNodeID, renewed.NodeID, telemetry.LogSerial, renewed.Serial, telemetry.LogPreviousSerial, serial,
			telemetry.LogNotAfter, renewed.NotAfter.Format(time.RFC3339))
		if r.cfg.OnRenewed != nil {
			r.cfg.OnRenewed(renewed)
		}
	}
}

// retryIn is the wait before the next attempt after a failure: the
// backoff's (retryWait, spread), but never past the expiry. It is at most
// 40% to 60% of what is left of the certificate's validity (drawn like the
// jitter, so a fleet of one expiry does not retry in lockstep), and at
// least MinBackoff: a renewal that keeps failing is retried ever more
// often as the expiry nears, and Loop gives up only once the certificate
// expired (load).
func (r *Renewer) retryIn(id *identity.Identity) time.Duration {
	return RetryIn(r.retryWait, id.NotAfter.Sub(r.serverTime.Now()), r.rand())
}

// RetryIn is the wait before retrying a failed renewal whose backoff
// asks for wait, with left of the certificate's validity left, for r in
// [0, 1): at most 40% to 60% of left (by r), at least MinBackoff.
func RetryIn(wait, left time.Duration, r float64) time.Duration {
	limit := time.Duration(float64(left) * (0.4 + 0.2*r))
	return max(min(wait, limit), MinBackoff)
}

// load loads the identity and refuses one a renewal cannot help.
func (r *Renewer) load() (*identity.Identity, error) {
	id, err := r.cfg.Store.Load()
	if err != nil {
		return nil, err
	}
	if r.serverTime.Expired(id.NotAfter) {
		return nil, errs.New(errs.InvalidState, "the certificate expired at %s and can no longer be renewed; %s",
			id.NotAfter.Format(time.RFC3339), identity.ExpiredFix(id.NotAfter))
	}
	return id, nil
}

// RenewOnce renews the certificate now and returns the saved identity. A
// failure leaves the current identity in place; every error is an *errs.E
// that says what happened.
func (r *Renewer) RenewOnce(ctx context.Context) (*identity.Identity, error) {
	id, err := r.load()
	if err != nil {
		return nil, err
	}
	leaf := id.Leaf()
	// R13.3: a certificate naming a TPM attestation key renews only with
	// the next key certified by that AK. bcd checks it can before sending:
	// the control plane would only refuse (never downgrade).
	var wantAK []byte
	var attester identity.KeyAttester
	// The statements in either SVID form (URI SANs or the strict form's
	// extension, R20.1).
	for _, st := range pki.CertStatements(leaf) {
		if !tpmverify.IsStatement(st) {
			continue
		}
		name, ok := tpmverify.ParseStatement(st)
		a, isTPM := r.keys.(identity.KeyAttester)
		if !ok || !isTPM {
			return nil, errs.New(errs.InvalidState,
				"the certificate names a TPM attestation key (%s), but no TPM is open (tpm.mode and tpm.device or tpm.simulator in config.toml); nothing was sent. Before it expires at %s, bring the TPM back, or join again as root: bcd join --reset --yes, then bcd join --attestor tpm",
				st, id.NotAfter.Format(time.RFC3339))
		}
		wantAK, attester = name, a
	}
	if id.SiteID != r.bcd.Site {
		return nil, errs.New(errs.InvalidState, "the identity in %s is of site %s, but config.toml names site %s; nothing was sent", r.cfg.Store.Dir, id.SiteID, r.bcd.Site)
	}

	signer, keyRecord, csr, err := r.nextKey(id)
	if err != nil {
		return nil, err
	}
	var keyAttestation []byte
	if attester != nil {
		att, akName, err := attester.AttestKey(signer, csr)
		if err != nil {
			return nil, errs.New(errs.InvalidState, "the TPM cannot certify the next node key: %v; nothing was sent. Before the certificate expires at %s, bring the TPM back, or join again as root: bcd join --reset --yes, then bcd join --attestor tpm", err, id.NotAfter.Format(time.RFC3339))
		}
		if !bytes.Equal(akName, wantAK) {
			return nil, errs.New(errs.InvalidState, "this TPM's attestation key is not the one the certificate names (the TPM was cleared or replaced); nothing was sent. Join again as root: bcd join --reset --yes, then bcd join --attestor tpm")
		}
		keyAttestation = att
	}
	res, err := r.send(ctx, id, csr, keyAttestation)
	if err != nil {
		return nil, err
	}
	body, err := r.verify(ctx, res, enroll.RenewExpectation{
		SigningPins: r.pins.Set(pki.KindJoinSigning), CSRHash: pki.CSRHash(csr), NodeKey: signer.Public(),
		TrustDomain: id.TrustDomain, SiteID: id.SiteID, NodeID: id.NodeID, Role: id.Role, Retired: r.pins.Retired(),
	})
	if err != nil {
		return nil, err
	}
	chainPEM, bundlePEM := pki.ChainPEM(body.GetCertChain()), pki.ChainPEM(body.GetCommandBundle())
	next, err := identity.NewIdentity(chainPEM, id.Attestor, id.JoinedAt)
	if err != nil {
		return nil, err
	}
	// R12.3: the generation from the signed answer (a renewal keeps it, and
	// tells an identity saved before bcd kept it); a server that does not
	// send it leaves what bcd knew.
	next.IdentityGeneration = id.IdentityGeneration
	if g := body.GetIdentityGeneration(); g > 0 {
		next.IdentityGeneration = g
	}
	if err := r.cfg.Store.Save(next, keyRecord, chainPEM, bundlePEM); err != nil {
		return nil, fmt.Errorf("save the renewed identity in %s: %w", r.cfg.Store.Dir, err)
	}
	r.mu.Lock()
	r.pending = nil
	r.mu.Unlock()
	saved, err := r.cfg.Store.Load()
	if err != nil {
		return nil, fmt.Errorf("reload the renewed identity: %w", err)
	}
	// R16.2: the verified answer's statements; a failure to save them is
	// logged and never fails the renewal, which is saved.
	_, _ = r.pins.Learn("renewal answer", body.GetKeyStatements())
	// R19.3: the signed answer's time.
	if _, err := r.serverTime.Learn(body.GetServerTimeUnixMs()); err != nil {
		r.log.Warn("not correcting for the control plane's time", telemetry.LogErr, err)
	}
	return saved, nil
}

// verify checks the renewal answer (enroll.VerifyRenewResponse). R21.1: an
// answer signed by a join-signing key bcd does not pin yet is accepted when
// a chain of statements from a pinned key vouches for it: the answer's own
// statements, or, when a relay dropped them (or a server before the field
// sent none), those the gateway's Keys answers. The control plane has
// already issued the certificate, so giving up here would strand the node.
func (r *Renewer) verify(ctx context.Context, res *agentv1.RenewResponse, want enroll.RenewExpectation) (*agentv1.JoinResponseBody, error) {
	body, err := enroll.VerifyRenewResponse(res, want)
	var re *enroll.ResponseError
	if err == nil || !errors.As(err, &re) || re.Check != enroll.CheckSignature || ctx.Err() != nil {
		return body, err
	}
	st, ferr := enroll.FetchKeyStatements(ctx, r.hc, r.bcd.GatewayURL, r.serverName())
	if ferr != nil || len(st) == 0 {
		return nil, err
	}
	r.log.Info("the renewal answer is signed by a key bcd does not pin yet: checking it against the gateway's key statements (only those a pinned key vouches for count)")
	want.Vouchers = st
	return enroll.VerifyRenewResponse(res, want)
}

// serverName is the TLS server name of the gateway: gateway_server_name,
// else the gateway URL's host ("" when the URL does not parse; the dial
// then fails with that error).
func (r *Renewer) serverName() string {
	if r.bcd.GatewayServerName != "" {
		return r.bcd.GatewayServerName
	}
	u, err := url.Parse(r.bcd.GatewayURL)
	if err != nil {
		return ""
	}
	return u.Hostname()
}

// NewRequest is the renewal request bcd sends (R13.1) for the node nodeID
// whose current certificate chain (DER, leaf first) and key are chain and
// signer: the new key's csr, the proof of possession by the current key
// dated now (the control plane's clock as bcd knows it), and the pins it
// holds, acknowledged by the current key over the CSR's hash (R21.2). A
// TPM's key attestation, when there is one, is the caller's to add.
func NewRequest(signer crypto.Signer, nodeID string, chain [][]byte, csr []byte, now time.Time, pins []string) (*agentv1.RenewRequest, error) {
	ms := now.UnixMilli()
	pop, err := pki.SignRenewPoP(signer, csr, nodeID, ms)
	if err != nil {
		return nil, fmt.Errorf("sign the proof of possession: %w", err)
	}
	pinsSig, err := pki.SignPinsAck(signer, pki.CSRHash(csr), pins)
	if err != nil {
		return nil, fmt.Errorf("sign the pins acknowledgement: %w", err)
	}
	return &agentv1.RenewRequest{Csr: csr, Chain: chain, ClientTimeUnixMs: ms, PopSig: pop, NodeId: nodeID, Pins: pins, PinsSig: pinsSig}, nil
}

// send signs the proof of possession for csr dated by the control plane's
// clock as bcd knows it and calls Renew. R19.3: a refusal (which does not
// say why, R13.5) sends it once more when the control plane's time, asked
// of the gateway (an unsigned hint), moved the offset by more than
// retryClockMove; a refusal with the clock off names it.
func (r *Renewer) send(ctx context.Context, id *identity.Identity, csr, keyAttestation []byte) (*agentv1.RenewResponse, error) {
	chain := make([][]byte, len(id.Chain))
	for i, c := range id.Chain {
		chain[i] = c.Raw
	}
	for retried := false; ; retried = true {
		req, err := NewRequest(id.Signer, id.NodeID, chain, csr, r.serverTime.StampNow(), r.pins.Held())
		if err != nil {
			return nil, err
		}
		req.KeyAttestation = keyAttestation
		res, err := r.call(ctx, id, chain, req)
		e, ok := errs.As(err)
		if err == nil || !ok || e.Code != errs.AccessDenied {
			return res, err
		}
		if !retried && ctx.Err() == nil && r.clockMoved(ctx) {
			r.log.Warn("renewal refused with this machine's clock off the control plane's; sending it again dated by the control plane's clock")
			continue
		}
		if off, learned := r.serverTime.Offset(); !learned.IsZero() && (off > clockNoteAfter || off < -clockNoteAfter) {
			return nil, errs.New(errs.AccessDenied, "%s; %s", e.Message, servertime.Describe(off))
		}
		return nil, err
	}
}

// clockNoteAfter is how far this machine's clock may be off the control
// plane's before a refused renewal names it: the renewal's client_time
// skew window.
const clockNoteAfter = time.Minute

// retryClockMove is how far a learned offset must move before a refused
// renewal is sent again: less cannot have caused the refusal.
const retryClockMove = 30 * time.Second

// clockMoved asks the gateway for the control plane's time and reports
// whether it moved what the next attempt is dated by more than
// retryClockMove. The answer is unsigned: it is a hint that dates the
// retry only (servertime.Hint, R21.4), never the learned offset.
func (r *Renewer) clockMoved(ctx context.Context) bool {
	ms, err := enroll.FetchServerTime(ctx, r.hc, r.bcd.GatewayURL, r.serverName())
	if err != nil || ms == 0 {
		return false
	}
	return r.serverTime.Hint(ms, retryClockMove)
}

// call calls Renew over the session's connection when bcd run's session is
// welcomed on the current certificate (Config.Session), else dials the
// gateway with the pinned TLS configuration and the current certificate as
// client certificate, and calls Renew. When the gateway's
// chain matches no pinned serving CA, it asks the gateway for rotated keys
// (enroll.RecoverPins, R16.2) and, when a pinned key vouched for a new
// serving CA, dials once more.
func (r *Renewer) call(ctx context.Context, id *identity.Identity, chain [][]byte, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	u, err := url.Parse(r.bcd.GatewayURL)
	if err != nil {
		return nil, errs.New(errs.InvalidConfig, "gateway_url: not a URL")
	}
	if hc := r.cfg.Session.For(id.Serial); hc != nil {
		// The session's connection presents this very certificate.
		res, err := renewOn(ctx, hc, r.bcd.GatewayURL, req)
		if err != nil {
			return nil, callError(err, u.Host)
		}
		return res, nil
	}
	serverName := r.bcd.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	res, err := r.callOnce(ctx, id, chain, req, serverName)
	if _, pinned := enroll.PinFailure(err); pinned && ctx.Err() == nil &&
		enroll.RecoverPins(ctx, r.pins, r.hc, r.bcd.GatewayURL, serverName, r.log) {
		res, err = r.callOnce(ctx, id, chain, req, serverName)
	}
	if err != nil {
		return nil, callError(err, u.Host)
	}
	return res, nil
}

// callOnce is one Renew call over TLS pinned to the serving-CA set now.
func (r *Renewer) callOnce(ctx context.Context, id *identity.Identity, chain [][]byte, req *agentv1.RenewRequest, serverName string) (*agentv1.RenewResponse, error) {
	tlsConfig, err := enroll.PinnedTLSConfig(r.pins.Set(pki.KindServingCA), serverName, r.clock.Now)
	if err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "%v", err)
	}
	// The caller's mTLS identity (R13.2). The gateway only requests a
	// client certificate, naming no CAs, so it is offered unconditionally.
	cert := &tls.Certificate{Certificate: chain, PrivateKey: id.Signer, Leaf: id.Leaf()}
	tlsConfig.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	tlsConfig.ClientSessionCache = r.cfg.Tickets.For(chain[0])
	hc := r.hc(tlsConfig)
	// The connection serves this one call: closed after it, rather than
	// left idle (holding buffers here and at the gateway) until it times
	// out.
	defer hc.CloseIdleConnections()
	return renewOn(ctx, hc, r.bcd.GatewayURL, req)
}

// renewOn is one Renew call on hc, bounded by renewTimeout.
func renewOn(ctx context.Context, hc connect.HTTPClient, gatewayURL string, req *agentv1.RenewRequest) (*agentv1.RenewResponse, error) {
	client := agentv1connect.NewJoinServiceClient(hc, gatewayURL, connect.WithGRPC(), connect.WithReadMaxBytes(maxResponseSize))
	ctx, cancel := context.WithTimeout(ctx, renewTimeout)
	defer cancel()
	res, err := client.Renew(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// callError turns a failed Renew call into the error the operator reads.
func callError(err error, gateway string) error {
	if msg, ok := enroll.PinFailure(err); ok {
		return errs.New(errs.Unauthenticated, "refusing the gateway %s: %s; nothing was sent", gateway, msg)
	}
	e, ok := errs.As(wire.FromWire(err))
	if !ok {
		return errs.Wrap(err, errs.Unavailable, "cannot renew through %s: %v", gateway, err)
	}
	switch e.Code {
	case errs.AccessDenied:
		// The node never learns why (R13.5); say where the reason is.
		return errs.New(errs.AccessDenied, "%s (the reason is recorded by the control plane as a security.renew.refused event)", e.Message)
	case errs.Unavailable:
		return errs.New(errs.Unavailable, "cannot renew through %s: %s", gateway, e.Message)
	case errs.InvalidState:
		// The control plane never answers a renewal so (a retired node is
		// refused, R13.2), and Loop gives up on INVALID_STATE: a relay's
		// answer must not stop the renewals of a valid certificate.
		return errs.New(errs.Unavailable, "cannot renew through %s: %s", gateway, e.Message)
	}
	return e
}
