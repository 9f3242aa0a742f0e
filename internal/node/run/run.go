// Package run is `bcd run`, the node daemon's service loop (R12.1): it
// keeps one long-lived session to the gateway over TLS pinned to the
// serving CA, presenting the node certificate as client certificate;
// answers the API's Challenge with Hello signed by the node key (the
// certificate alone proves nothing to the API); sends heartbeats, signed
// by the node key too, or MAC'd under a key agreed with the API for the
// session when the API offers one (pki.DeriveHeartbeatKey: bcd's
// ephemeral key is bound by its Hello proof);
// reconnects with exponential backoff and jitter; and runs the commands the
// control plane sends, after verifying each one against the
// command-signing bundle from the join (R12.3), answering each with a
// result signed by the node key. Only bcd's CLI imports it.
//
// SECURITY: a command runs only when its signature verifies under a key of
// bundle.pem for purpose "command", it names this node and this identity
// generation, it has not expired, and its id is not among the commands
// this node ran (RanFile in the data directory, written before the command
// runs, so at most once even across a crash or restart); anything else is
// answered with an error result and not run. The gateway relays commands
// but cannot forge, alter or replay them.
//
// Every wait (heartbeats, the reconnect backoff, the identity check) is on
// the injected clock, so tests move time instead of sleeping.
//
// A retired node is told so by the API once it proved its key; Run then
// returns ErrRetired at once instead of reconnecting forever (bcd run exits
// with its own code, and bcd.service does not restart it).
//
// The certificate renewer (internal/node/renew), when given, runs in the
// same process; the session notices a new identity on disk and reconnects
// with it. NewProcess (process.go) wires the whole of bcd run (the
// daemon, its renewer, the re-join and the diagnostics listener) for bcd's
// command and the tests alike; its Run returns once every goroutine it
// started has. How soon bcd reconnects after a session ended (a renewal or an
// expiry is not a failure; a failure backs off) is in recover.go (R19.3).
package run

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/nodesession"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/node/site"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	tracing "github.com/better-compute/better-compute/internal/shared/tracing/lite"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Reconnect backoff bounds (recover.go; nodesession's, which the load
// generator's lean holder shares).
const (
	MinBackoff = nodesession.MinBackoff
	MaxBackoff = nodesession.MaxBackoff
	// FirstReconnectSpread is the window the first reconnect after a
	// failure is drawn from, so a fleet that lost its gateway or API at
	// once does not come back at once.
	FirstReconnectSpread = nodesession.FirstReconnectSpread
	// maxMessageBytes bounds one session message either way.
	maxMessageBytes = 64 << 10
	// maxPendingResults bounds the answers waiting for a session.
	maxPendingResults = 64
	// minHeaderTable is the smallest HPACK dynamic table net/http takes
	// (0 means its default, 4 KiB): no header field fits, none is kept.
	minHeaderTable = 1
)

// ErrRetired is returned (wrapped) by Run when the control plane says this
// node was retired: no session will ever be admitted again, so bcd stops.
var ErrRetired = errs.New(errs.InvalidState,
	"this node was retired; it can no longer connect or renew, and bcd stops. To use this machine again, join it anew as root: bcd join --reset --yes, then bcd join with a new token")

// Renewer is the certificate renewer run alongside (renew.Renewer).
type Renewer interface {
	Loop(ctx context.Context) error
}

// Config lists the daemon's dependencies.
type Config struct {
	// BCD is the loaded configuration; required.
	BCD *bcdconfig.Config
	// Store is the identity's data directory; required.
	Store *identity.Store
	// Clock is the time source; nil means the wall clock.
	Clock clock.Clock
	// Log receives the daemon's lines; nil discards.
	Log *slog.Logger
	// HTTPClient makes the session's HTTP client from the TLS config (which
	// carries the pinned verification and the node certificate); nil: an
	// HTTP/2 transport per connection attempt.
	HTTPClient enroll.HTTPClientFunc
	// Tracer records each session's open (tracing.SpanSessionOpen, whose
	// context goes to the gateway with the stream) and each command's
	// handling (tracing.SpanCommand) (R17.3); nil: the global provider, a
	// no-op unless tracing.Setup ran.
	Tracer trace.TracerProvider
	// Renewer, when set, runs in the same process (seam for
	// internal/node/renew).
	Renewer Renewer
	// NotifySocket is $NOTIFY_SOCKET (systemd); "" sends nothing.
	NotifySocket string
	// IdentityCheck is how often the identity on disk is re-read to notice
	// a renewal (default 30 s).
	IdentityCheck time.Duration
	// Renewed, when set, tells the session that the identity on disk
	// changed (the renewer's OnRenewed): it is re-read at once, so the next
	// session uses the new certificate without waiting for IdentityCheck
	// (R19.3).
	Renewed <-chan struct{}
	// Rand returns a number in [0, 1) for the jitter; nil: math/rand/v2.
	Rand func() float64
	// OnWelcome, when set, is called after each Welcome (tests).
	OnWelcome func(nodeID string)
	// OnSessionEnded, when set, is called each time a session ends, with
	// why (bcd's diagnostics: no session, R17.2).
	OnSessionEnded func(err error)
	// BootedCheck is how often a site agent reads its booted file for
	// machines to report (default 2 s); BootedFile is that file (default
	// site.BootedPath of the data directory).
	BootedCheck time.Duration
	BootedFile  string
	// Pins are the live pin sets (R16.2), shared with the renewer; nil:
	// BCD's, kept in memory only.
	Pins *config.Pins
	// Tickets, when set, resumes the gateway's TLS sessions of the
	// current identity (shared with the renewer; enroll.TicketCache).
	Tickets *enroll.TicketCache
	// SessionConn, when set, is offered each welcomed session's client,
	// so the renewer renews over the session's connection (shared with
	// the renewer: renew.SessionConn).
	SessionConn *renew.SessionConn
	// ServerTime is the control plane's clock as bcd knows it (R19.3):
	// certificate expiry and command expiry are read by it; the signed
	// renewal answers correct it (R21.4). nil: one persisted in Store.Dir
	// (bcd run shares its renewer's).
	ServerTime *servertime.Offset
	// Rejoin, when set, re-joins the node by x509pop with its expired
	// certificate's key (enroll, R21.5) and returns the new identity: a
	// daemon whose certificate expired (it was offline, or the control
	// plane was unreachable through the renewal window) comes back by
	// itself. nil: an expired certificate stops bcd run with the command
	// to run.
	Rejoin func(ctx context.Context) (*identity.Identity, error)
}

// Daemon is bcd's service loop. Build it with New.
type Daemon struct {
	cfg   Config
	clock clock.Clock
	// serverTime reads expiry by the control plane's clock (Config.ServerTime).
	serverTime *servertime.Offset
	log        *slog.Logger
	rand       func() float64
	ready      bool
	// beat is the heartbeat interval the last Welcome named (recover.go).
	beat time.Duration
	ran  *ranLog
	// results are the answers waiting to be signed and sent, by whichever
	// session is up: a command that outlives its session is answered on
	// the next one.
	results chan *answer
	// pins are the live pin sets; pinFailed notes a session that failed on
	// the gateway's chain (pins.go).
	pins      *config.Pins
	pinFailed atomic.Bool
	// rejoined tells the renewer's loop that a re-join saved a new
	// identity, so it renews that one (rejoin.go).
	rejoined chan struct{}
	// commands are the commands running: one may outlive its session (its
	// answer goes on the next), never Run.
	commands sync.WaitGroup
}

// answer is a command's result waiting for a session to sign and send it,
// with the identity generation the command named.
type answer struct {
	res        *agentv1.CommandResult
	generation int64
	// ran, when set, is the command id whose run this answers: it counts
	// as running until the answer is sent, so a second delivery meanwhile
	// (the API re-queues a command whose session ended) is not answered
	// "replayed" ahead of the real answer.
	ran string
}

// sent marks a's run over (its answer left, or was dropped).
func (d *Daemon) sent(a *answer) {
	if a.ran != "" {
		d.ran.end(a.ran)
	}
}

// New returns a Daemon. Errors are INVALID_CONFIG.
func New(cfg Config) (*Daemon, error) {
	if cfg.BCD == nil {
		return nil, errs.New(errs.InvalidConfig, "run: no bcd configuration (config.toml)")
	}
	if cfg.Store == nil || cfg.Store.Dir == "" {
		return nil, errs.New(errs.InvalidConfig, "run: no data directory")
	}
	d := &Daemon{cfg: cfg, clock: cfg.Clock, log: cfg.Log, rand: cfg.Rand, results: make(chan *answer, maxPendingResults), rejoined: make(chan struct{}, 1)}
	if d.clock == nil {
		d.clock = clock.Real{}
	}
	if d.serverTime = cfg.ServerTime; d.serverTime == nil {
		d.serverTime = servertime.New(servertime.Config{Dir: cfg.Store.Dir, Clock: d.clock})
	}
	d.ran = newRanLog(cfg.Store.Dir, d.clock)
	d.pins = livePins(cfg)
	if d.log == nil {
		d.log = slog.New(slog.DiscardHandler)
	}
	if d.rand == nil {
		d.rand = rand.Float64
	}
	if d.cfg.IdentityCheck <= 0 {
		d.cfg.IdentityCheck = 30 * time.Second
	}
	if d.cfg.BootedCheck <= 0 {
		d.cfg.BootedCheck = 2 * time.Second
	}
	if d.cfg.BootedFile == "" {
		d.cfg.BootedFile = site.BootedPath(cfg.Store.Dir)
	}
	return d, nil
}

// Backoff is the wait before reconnect attempt n (1-based) before jitter:
// 1 s doubling to 60 s. The first attempt after a session ended is spread
// over FirstReconnectSpread instead (recover.go).
func Backoff(n int) time.Duration { return backoff.Policy{Min: MinBackoff, Max: MaxBackoff}.Delay(n) }

// Run keeps the session up until ctx ends (SIGTERM), then returns nil. It
// returns an error at once when the identity cannot be used (not joined,
// damaged, expired), and ErrRetired when the control plane says the node
// was retired.
func (d *Daemon) Run(ctx context.Context) error {
	if _, err := d.usable(ctx); err != nil {
		return err
	}
	defer d.notify("STOPPING=1")
	// The renewer and the commands run until Run returns, and Run waits
	// for them.
	ctx, stop := context.WithCancel(ctx)
	var renewing sync.WaitGroup
	defer func() { stop(); renewing.Wait(); d.commands.Wait() }()
	if d.cfg.Renewer != nil {
		renewing.Go(func() { d.renewLoop(ctx) })
	}
	failures, serial := 0, ""
	for ctx.Err() == nil {
		id, err := d.usable(ctx)
		if err == nil {
			// R19.3: not on a certificate about to expire (recover.go).
			id, err = d.awaitUsable(ctx, id)
		}
		if ctx.Err() != nil {
			break
		}
		if err != nil {
			// Expired or damaged while running: a session cannot help.
			return err
		}
		if id.Serial != serial {
			failures, serial = 0, id.Serial // joined or renewed: a fresh start
		}
		start := d.clock.Now()
		err = d.sessionRecovering(ctx, id)
		if ctx.Err() != nil {
			break
		}
		if wire.IsNodeRetired(err) {
			d.log.Error("this node was retired: stopping", telemetry.LogNodeID, id.NodeID)
			return fmt.Errorf("%w", ErrRetired)
		}
		if d.cfg.OnSessionEnded != nil {
			d.cfg.OnSessionEnded(err)
		}
		if d.lifecycleEnd(id, err) {
			d.log.Info("session ended by the certificate's renewal or expiry: reconnecting", telemetry.LogErr, err)
			continue
		}
		if d.clock.Since(start) >= nodesession.StableAfter {
			failures = 0
		}
		failures++
		wait := nodesession.ReconnectWait(failures, d.rand())
		d.log.Warn("session ended", telemetry.LogErr, err, telemetry.LogReconnectIn, wait.Round(time.Millisecond).String(), telemetry.LogAttempt, failures)
		d.sleepOrRenewed(ctx, wait)
	}
	d.log.Info("shutting down")
	return nil
}

var errIdentityChanged = errors.New("the identity changed")

// tlsConfig is the pinned gateway TLS configuration with the node
// certificate as client certificate.
func (d *Daemon) tlsConfig(id *identity.Identity) (*tls.Config, string, error) {
	u, err := url.Parse(d.cfg.BCD.GatewayURL)
	if err != nil {
		return nil, "", errs.New(errs.InvalidConfig, "gateway_url: not a URL")
	}
	serverName := d.cfg.BCD.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	tc, err := enroll.PinnedTLSConfig(d.servingCAPins(), serverName, d.clock.Now)
	if err != nil {
		return nil, "", errs.Wrap(err, errs.InvalidConfig, "%v", err)
	}
	d.notePinFailure(tc)
	chain := make([][]byte, len(id.Chain))
	for i, c := range id.Chain {
		chain[i] = c.Raw
	}
	tc.Certificates = []tls.Certificate{{Certificate: chain, PrivateKey: id.Signer, Leaf: id.Leaf()}}
	tc.ClientSessionCache = d.cfg.Tickets.For(chain[0])
	tc.NextProtos = []string{"h2"}
	return tc, u.Host, nil
}

// httpClient is the session's HTTP client, whose calls carry the trace
// context (tracing.Transport: nothing when tracing is off).
func (d *Daemon) httpClient(tc *tls.Config) (*http.Client, func()) {
	if d.cfg.HTTPClient != nil {
		base := d.cfg.HTTPClient(tc)
		c := *base
		c.Transport = tracing.Transport(d.cfg.Tracer, c.Transport)
		// The next session presents another certificate or dials anew:
		// this one's connection is closed with it, rather than left idle
		// (its buffers here and at the gateway) until it times out.
		return &c, base.CloseIdleConnections
	}
	tr := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: 15 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     tc,
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: 15 * time.Second,
		HTTP2: &http.HTTP2Config{SendPingTimeout: 60 * time.Second, PingTimeout: 20 * time.Second,
			// No HPACK dynamic tables (4 KiB each by default) either way:
			// a session's connection carries one stream and the odd
			// renewal, so they would index next to nothing, and the
			// gateway keeps one per daemon too.
			MaxDecoderHeaderTableSize: minHeaderTable, MaxEncoderHeaderTableSize: minHeaderTable},
	}
	return &http.Client{Transport: tracing.Transport(d.cfg.Tracer, tr)}, tr.CloseIdleConnections
}

// sessionStream is the session's bidi stream.
type sessionStream = *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]

// session runs one session until it fails, ctx ends, or the identity on
// disk changes. Commands it receives run under runCtx (Run's), so one that
// outlives the session is answered on the next.
func (d *Daemon) session(runCtx context.Context, id *identity.Identity) error {
	tc, host, err := d.tlsConfig(id)
	if err != nil {
		return err
	}
	hc, closeIdle := d.httpClient(tc)
	defer closeIdle()
	client := agentv1connect.NewSessionServiceClient(hc, d.cfg.BCD.GatewayURL, connect.WithGRPC(),
		connect.WithReadMaxBytes(maxMessageBytes), connect.WithSendMaxBytes(maxMessageBytes))
	ctx, cancel := context.WithCancelCause(runCtx)
	defer cancel(nil)
	// R17.3: the open is the root of the session's trace; the stream
	// carries its context to the gateway and the API.
	openCtx, open := tracing.StartOn(ctx, d.cfg.Tracer, tracing.SpanSessionOpen, trace.WithAttributes(attribute.String(tracing.AttrNodeID, id.NodeID)))
	stream := client.Connect(openCtx)
	defer func() { _ = stream.CloseResponse() }()
	// Canceling the stream's context does not end it while its request
	// body is open (net/http watches the context only once the body is
	// written): the end of the session closes the request body too, so a
	// Receive in progress returns. Safe alongside a Send.
	defer context.AfterFunc(ctx, func() { _ = stream.CloseRequest() })()
	beats, beat, err := d.handshake(openCtx, stream, id, host)
	tracing.End(open, err)
	if err != nil {
		return err
	}
	// The renewer may renew this certificate over this connection while
	// the session lasts (renew.SessionConn).
	defer d.cfg.SessionConn.Offer(id.Serial, hc)()
	// Commands are handled in spans under the session's open, with Run's
	// cancellation.
	cmdCtx := trace.ContextWithSpanContext(runCtx, open.SpanContext())
	// The session's sender (which also watches the identity) ends with
	// it.
	var loops sync.WaitGroup
	defer func() { cancel(nil); loops.Wait() }()
	loops.Go(func() { d.sendLoop(ctx, cancel, stream, id, beats, beat) })
	for {
		m, err := stream.Receive()
		if err != nil {
			if c := context.Cause(ctx); c != nil && !errors.Is(c, context.Canceled) {
				return c
			}
			return d.streamError(host, stream, err)
		}
		sc := m.GetCommand()
		if sc == nil {
			continue
		}
		d.commands.Go(func() {
			ctx, span := tracing.StartOn(cmdCtx, d.cfg.Tracer, tracing.SpanCommand)
			res := d.command(ctx, id, sc)
			span.End()
			if res == nil {
				return
			}
			select {
			case d.results <- res:
			case <-runCtx.Done():
				d.sent(res)
			}
		})
	}
}

// handshake opens the session (R12.1): the API speaks first with its
// Challenge, bcd answers Hello with its proof over the nonce (and over the
// ephemeral heartbeat key it always offers), and the API welcomes this
// node, with its own heartbeat key when it agrees one. It returns the
// session's heartbeats and their interval.
func (d *Daemon) handshake(ctx context.Context, stream sessionStream, id *identity.Identity, host string) (*nodesession.Beats, time.Duration, error) {
	// Open the stream without a message and read the Challenge.
	if err := stream.Send(nil); err != nil {
		return nil, 0, d.streamError(host, stream, err)
	}
	first, err := stream.Receive()
	if err != nil {
		return nil, 0, d.streamError(host, stream, err)
	}
	nonce := first.GetChallenge().GetNonce()
	if len(nonce) != pki.SessionNonceSize {
		return nil, 0, fmt.Errorf("the gateway %s opened the session without the control plane's challenge", host)
	}
	// R12.1: prove the node key is here, for this certificate and this
	// session's nonce, and bind this session's heartbeat key to it (a
	// relay can neither replace nor strip it). R21.2: the pins this
	// daemon holds, so the control plane knows when it has learned a
	// rotation's keys.
	opening, hello, err := nodesession.Answer(id.Signer, id.NodeID, id.Leaf().Raw, nonce, d.pins.Held())
	if err != nil {
		return nil, 0, err
	}
	if err := stream.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: hello}}); err != nil {
		return nil, 0, d.streamError(host, stream, err)
	}
	welcome, err := stream.Receive()
	if err != nil {
		return nil, 0, d.streamError(host, stream, err)
	}
	w := welcome.GetWelcome()
	if w == nil || w.GetNodeId() != id.NodeID {
		return nil, 0, fmt.Errorf("the gateway answered Hello without this node's Welcome")
	}
	// MAC'd heartbeats when the API agreed a heartbeat key (nodesession).
	b, beat, err := opening.Welcomed(w)
	if err != nil {
		return nil, 0, fmt.Errorf("the gateway %s relayed a Welcome with an unusable heartbeat key: %w", host, err)
	}
	d.learnWelcome(w)
	// R21.4: Welcome's time is not signed, and the gateway relays it: it
	// never moves bcd's clock (a forged one could run an expired command,
	// or stop renewals). The signed renewal answers correct the clock.
	d.beat = beat
	d.log.InfoContext(ctx, "session open", telemetry.LogNodeID, id.NodeID, telemetry.LogGateway, host, telemetry.LogHeartbeat, beat.String())
	if !d.ready {
		d.ready = true
		d.notify("READY=1")
	}
	if d.cfg.OnWelcome != nil {
		d.cfg.OnWelcome(id.NodeID)
	}
	return b, beat, nil
}

// sendLoop is the session's one sender: heartbeats, site reports and
// command results, each signed by this session's node key (heartbeats over
// the nonce and a sequence number, or MAC'd under the session's heartbeat
// key, so no relay can keep the session alive without this daemon). A
// failure ends the session through cancel. It also ends the session when
// the identity on disk has another serial (a renewal), so the next session
// uses the new certificate: it looks every IdentityCheck, and at once when
// Renewed says so (one goroutine for both: a held session costs bcd as few
// as it can).
func (d *Daemon) sendLoop(ctx context.Context, cancel context.CancelCauseFunc, stream sessionStream, id *identity.Identity, hb *nodesession.Beats, beat time.Duration) {
	t := d.clock.NewTicker(beat)
	defer t.Stop()
	check := d.clock.NewTicker(d.cfg.IdentityCheck)
	defer check.Stop()
	// R10.4: a site agent reports the machines its site booted.
	var booted <-chan time.Time
	var reports *siteReports
	if id.Role == pki.RoleSite {
		bt := d.clock.NewTicker(d.cfg.BootedCheck)
		defer bt.Stop()
		booted, reports = bt.C(), &siteReports{file: d.cfg.BootedFile, sent: map[string]site.Machine{}}
	}
	var seq uint64
	for {
		var m *agentv1.SessionClientMessage
		var res *answer
		select {
		case <-ctx.Done():
			return
		case <-check.C():
			if d.identityChanged(cancel, id) {
				return
			}
			continue
		case <-d.cfg.Renewed:
			if d.identityChanged(cancel, id) {
				return
			}
			continue
		case <-booted:
			r, err := reports.next(id, hb.Nonce(), d.log)
			if err != nil {
				cancel(err)
				return
			}
			if r == nil {
				continue
			}
			m = &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_SiteReport{SiteReport: r}}
		case <-t.C():
			seq++
			h, err := hb.Make(seq)
			if err != nil {
				cancel(fmt.Errorf("sign a heartbeat: %w", err))
				return
			}
			m = &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: h}}
		case res = <-d.results:
			signed, err := d.sign(id, res)
			if err != nil {
				d.log.Error("sign a command result", telemetry.LogCommand, res.res.GetCommandId(), telemetry.LogErr, err)
				d.sent(res)
				continue
			}
			m = &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: signed}}
		}
		if err := stream.Send(m); err != nil {
			if res != nil {
				d.requeueResult(res) // for the next session
			}
			cancel(fmt.Errorf("send: %w", err))
			return
		}
		if res != nil {
			d.sent(res)
		}
	}
}

// identityChanged ends the session (through cancel) and reports true when
// the identity on disk has another serial than id's.
func (d *Daemon) identityChanged(cancel context.CancelCauseFunc, id *identity.Identity) bool {
	cur, err := d.cfg.Store.Load()
	if err == nil && cur.Serial != id.Serial {
		cancel(errIdentityChanged)
		return true
	}
	return false
}

// sign signs a's result with the session identity's node key: the
// command's id, this node, the generation the command named, ok, the
// output's hash and the error (pki.CommandResultMessage).
func (d *Daemon) sign(id *identity.Identity, a *answer) (*agentv1.CommandResult, error) {
	return nodesession.SignResult(id.Signer, id.NodeID, a.generation, a.res)
}

// requeueResult puts an answer a session could not send back for the next
// one, unless the queue is full (the command then expires unanswered).
func (d *Daemon) requeueResult(a *answer) {
	select {
	case d.results <- a:
	default:
		d.log.Warn("command answer dropped: too many waiting", telemetry.LogCommand, a.res.GetCommandId())
		d.sent(a)
	}
}

func (d *Daemon) streamError(host string, stream *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage], err error) error {
	if errors.Is(err, io.EOF) {
		// Send reports EOF when the server ended the stream; its reason
		// comes from Receive.
		if _, rerr := stream.Receive(); rerr != nil && !errors.Is(rerr, io.EOF) {
			err = rerr
		} else {
			return fmt.Errorf("the gateway %s ended the session", host)
		}
	}
	if e, ok := errs.As(wire.FromWire(err)); ok {
		return fmt.Errorf("session through %s: %w", host, e)
	}
	return fmt.Errorf("session through %s: %w", host, err)
}

// Refusal reasons answered in CommandResult.error.
const (
	RefusedSignature  = "signature"
	RefusedNode       = "node"
	RefusedGeneration = "generation"
	RefusedExpired    = "expired"
	RefusedMalformed  = "malformed"
	// RefusedReplayed answers a command id this node ran already (its
	// first answer may have been lost): it is not run again.
	RefusedReplayed = "replayed"
)

// Verify checks a signed command as bcd does before running it: the
// signature under a key of the command-signing bundle (purpose command),
// this node's id, this identity generation, and the expiry at now. It
// returns the body (as far as it parsed) and, when refused, the reason.
//
// The generation: an identity that knows its generation (from the signed
// join or renewal answer) takes only commands naming it. One saved before
// bcd kept the generation (0) takes only commands issued at or after it
// joined: a command of an older generation (a relay replaying one captured
// before a reclaim) was issued before this identity existed. The next
// renewal tells it the generation.
func Verify(id *identity.Identity, sc *agentv1.SignedCommand, now time.Time) (*agentv1.CommandBody, string) {
	body := &agentv1.CommandBody{}
	if err := proto.Unmarshal(sc.GetBody(), body); err != nil {
		return body, RefusedMalformed
	}
	verified := false
	for _, c := range id.Bundle {
		if pki.VerifyPurpose(c.PublicKey, pki.PurposeCommand, sc.GetBody(), sc.GetSig()) == nil {
			verified = true
			break
		}
	}
	switch {
	case !verified:
		return body, RefusedSignature
	case body.GetNodeId() != id.NodeID:
		return body, RefusedNode
	case id.IdentityGeneration > 0 && body.GetIdentityGeneration() != id.IdentityGeneration:
		return body, RefusedGeneration
	case id.IdentityGeneration == 0 && body.GetIssuedAtUnixMs() < id.JoinedAt.UnixMilli():
		return body, RefusedGeneration
	case now.UnixMilli() >= body.GetExpiresAtUnixMs():
		return body, RefusedExpired
	}
	return body, ""
}

// command verifies and runs one command, and returns its answer (unsigned:
// the session that sends it signs it), or nil when the same command is
// running already (that run answers).
func (d *Daemon) command(ctx context.Context, id *identity.Identity, sc *agentv1.SignedCommand) *answer {
	body, refused := Verify(id, sc, d.serverTime.Now())
	res := &agentv1.CommandResult{CommandId: body.GetCommandId()}
	a := &answer{res: res, generation: body.GetIdentityGeneration()}
	span := trace.SpanFromContext(ctx)
	span.SetAttributes(attribute.String(tracing.AttrCommandKind, body.GetKind()))
	if refused != "" {
		span.SetStatus(codes.Error, refused)
		d.log.WarnContext(ctx, "command refused", telemetry.LogCommand, body.GetCommandId(), telemetry.LogKind, body.GetKind(), telemetry.LogReason, refused)
		res.Error = refused
		return a
	}
	// At most once: recorded on disk before it runs.
	state, err := d.ran.begin(body.GetCommandId(), time.UnixMilli(body.GetExpiresAtUnixMs()))
	switch {
	case err != nil:
		d.log.ErrorContext(ctx, "command not run: it could not be recorded first", telemetry.LogCommand, body.GetCommandId(), telemetry.LogErr, err)
		res.Error = "not run: cannot record it before running it: " + err.Error()
		return a
	case state == ranRunning:
		return nil
	case state == ranBefore:
		d.log.WarnContext(ctx, "command refused: this node ran it already", telemetry.LogCommand, body.GetCommandId(), telemetry.LogKind, body.GetKind())
		res.Error = RefusedReplayed
		return a
	}
	a.ran = body.GetCommandId() // running until its answer is sent
	out, err := Execute(ctx, d.cfg.BCD.ProcfsRoot, body.GetKind(), body.GetArgs())
	if err != nil {
		res.Error = err.Error()
		return a
	}
	res.Ok, res.Output = true, out
	d.log.InfoContext(ctx, "command done", telemetry.LogCommand, body.GetCommandId(), telemetry.LogKind, body.GetKind())
	return a
}
