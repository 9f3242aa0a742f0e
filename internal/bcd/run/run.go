// Package run is `bcd run`, the node daemon's service loop (R12.1): it
// keeps one long-lived session to the gateway over TLS pinned to the
// serving CA, presenting the node certificate as client certificate; sends
// Hello and heartbeats; reconnects with exponential backoff and jitter; and
// runs the commands the control plane sends, after verifying each one
// against the command-signing bundle from the join (R12.3).
//
// SECURITY: a command runs only when its signature verifies under a key of
// bundle.pem for purpose "command", it names this node, and it has not
// expired; anything else is answered with an error result and not run.
// The gateway relays commands but cannot forge them.
//
// The certificate renewer (internal/bcd/renew), when given, runs in the
// same process; the session notices a new identity on disk and reconnects
// with it.
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
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/bcd/doctor"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	"github.com/better-compute/better-compute/internal/bcd/join"
	"github.com/better-compute/better-compute/internal/clock"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/version"
	"github.com/better-compute/better-compute/internal/wire"
)

// Reconnect backoff bounds.
const (
	MinBackoff = time.Second
	MaxBackoff = 60 * time.Second
	// maxMessageBytes bounds one session message either way.
	maxMessageBytes = 64 << 10
	// defaultHeartbeat is used when Welcome names none.
	defaultHeartbeat = 15 * time.Second
	// stableAfter: a session that lasted this long resets the backoff.
	stableAfter = 30 * time.Second
)

// Renewer is the certificate renewer run alongside (renew.Renewer).
type Renewer interface {
	Loop(ctx context.Context) error
}

// Config lists the daemon's dependencies.
type Config struct {
	// BCD is the loaded configuration; required.
	BCD *config.Config
	// Store is the identity's data directory; required.
	Store *identity.Store
	// Clock is the time source; nil means the wall clock.
	Clock clock.Clock
	// Log receives the daemon's lines; nil discards.
	Log *slog.Logger
	// HTTPClient makes the session's HTTP client from the TLS config (which
	// carries the pinned verification and the node certificate); nil: an
	// HTTP/2 transport per connection attempt.
	HTTPClient join.HTTPClientFunc
	// Renewer, when set, runs in the same process (seam for
	// internal/bcd/renew).
	Renewer Renewer
	// NotifySocket is $NOTIFY_SOCKET (systemd); "" sends nothing.
	NotifySocket string
	// IdentityCheck is how often the identity on disk is re-read to notice
	// a renewal (default 30 s).
	IdentityCheck time.Duration
	// Rand returns a number in [0, 1) for the jitter; nil: math/rand/v2.
	Rand func() float64
	// OnWelcome, when set, is called after each Welcome (tests).
	OnWelcome func(nodeID string)
}

// Daemon is bcd's service loop. Build it with New.
type Daemon struct {
	cfg   Config
	clock clock.Clock
	log   *slog.Logger
	rand  func() float64
	ready bool
}

// New returns a Daemon. Errors are INVALID_CONFIG.
func New(cfg Config) (*Daemon, error) {
	if cfg.BCD == nil {
		return nil, errs.New(errs.InvalidConfig, "run: no bcd configuration (config.toml)")
	}
	if cfg.Store == nil || cfg.Store.Dir == "" {
		return nil, errs.New(errs.InvalidConfig, "run: no data directory")
	}
	d := &Daemon{cfg: cfg, clock: cfg.Clock, log: cfg.Log, rand: cfg.Rand}
	if d.clock == nil {
		d.clock = clock.Real{}
	}
	if d.log == nil {
		d.log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if d.rand == nil {
		d.rand = rand.Float64
	}
	if d.cfg.IdentityCheck <= 0 {
		d.cfg.IdentityCheck = 30 * time.Second
	}
	return d, nil
}

// load loads the identity and refuses an expired one the way bcd doctor
// reports it (R11.4).
func (d *Daemon) load() (*identity.Identity, error) {
	id, err := d.cfg.Store.Load()
	if err != nil {
		return nil, err
	}
	if id.Expired(d.clock.Now()) {
		return nil, errs.New(errs.InvalidState, "%s", doctor.ExpiredMessage(id.NotAfter))
	}
	return id, nil
}

// Backoff is the wait before reconnect attempt n (1-based) before jitter:
// 1 s doubling to 60 s.
func Backoff(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	return min(MinBackoff<<min(n-1, 6), MaxBackoff)
}

// Run keeps the session up until ctx ends (SIGTERM), then returns nil. It
// returns an error at once when the identity cannot be used (not joined,
// damaged, expired).
func (d *Daemon) Run(ctx context.Context) error {
	if _, err := d.load(); err != nil {
		return err
	}
	defer d.notify("STOPPING=1")
	if d.cfg.Renewer != nil {
		go func() {
			if err := d.cfg.Renewer.Loop(ctx); err != nil && ctx.Err() == nil {
				d.log.Error("certificate renewal stopped", "err", err)
			}
		}()
	}
	failures := 0
	for ctx.Err() == nil {
		id, err := d.load()
		if err != nil {
			// Expired or damaged while running: a session cannot help.
			return err
		}
		start := d.clock.Now()
		err = d.session(ctx, id)
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, errIdentityChanged) {
			d.log.Info("identity renewed: reconnecting")
			failures = 0
			continue
		}
		if d.clock.Now().Sub(start) >= stableAfter {
			failures = 0
		}
		failures++
		wait := Backoff(failures)
		wait = time.Duration(float64(wait) * (0.8 + 0.4*d.rand()))
		d.log.Warn("session ended", "err", err, "reconnect_in", wait.Round(time.Millisecond).String(), "attempt", failures)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
		}
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
	tc, err := join.PinnedTLSConfig(d.cfg.BCD.ServingCASPKIPin, serverName, d.clock.Now)
	if err != nil {
		return nil, "", errs.New(errs.InvalidConfig, "%v", err)
	}
	chain := make([][]byte, len(id.Chain))
	for i, c := range id.Chain {
		chain[i] = c.Raw
	}
	tc.Certificates = []tls.Certificate{{Certificate: chain, PrivateKey: id.Signer, Leaf: id.Leaf()}}
	tc.NextProtos = []string{"h2"}
	return tc, u.Host, nil
}

func (d *Daemon) httpClient(tc *tls.Config) (*http.Client, func()) {
	if d.cfg.HTTPClient != nil {
		return d.cfg.HTTPClient(tc), func() {}
	}
	tr := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         (&net.Dialer{Timeout: 15 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     tc,
		ForceAttemptHTTP2:   true,
		TLSHandshakeTimeout: 15 * time.Second,
		HTTP2:               &http.HTTP2Config{SendPingTimeout: 60 * time.Second, PingTimeout: 20 * time.Second},
	}
	return &http.Client{Transport: tr}, tr.CloseIdleConnections
}

// session runs one session until it fails, ctx ends, or the identity on
// disk changes.
func (d *Daemon) session(ctx context.Context, id *identity.Identity) error {
	tc, host, err := d.tlsConfig(id)
	if err != nil {
		return err
	}
	hc, closeIdle := d.httpClient(tc)
	defer closeIdle()
	client := agentv1connect.NewSessionServiceClient(hc, d.cfg.BCD.GatewayURL, connect.WithGRPC(),
		connect.WithReadMaxBytes(maxMessageBytes), connect.WithSendMaxBytes(maxMessageBytes))
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stream := client.Connect(ctx)
	defer func() { _ = stream.CloseResponse() }()
	if err := stream.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{
		Protocol: version.ProtocolMax, BcdVersion: version.Version}}}); err != nil {
		return d.streamError(host, stream, err)
	}
	first, err := stream.Receive()
	if err != nil {
		return d.streamError(host, stream, err)
	}
	w := first.GetWelcome()
	if w == nil || w.GetNodeId() != id.NodeID {
		return fmt.Errorf("the gateway answered Hello without this node's Welcome")
	}
	beat := time.Duration(w.GetHeartbeatSeconds()) * time.Second
	if beat <= 0 {
		beat = defaultHeartbeat
	}
	d.log.Info("session open", "node", id.NodeID, "gateway", host, "heartbeat", beat.String())
	if !d.ready {
		d.ready = true
		d.notify("READY=1")
	}
	if d.cfg.OnWelcome != nil {
		d.cfg.OnWelcome(id.NodeID)
	}

	// One goroutine sends: heartbeats and results.
	out := make(chan *agentv1.SessionClientMessage, 16)
	go func() {
		t := time.NewTicker(beat)
		defer t.Stop()
		for {
			var m *agentv1.SessionClientMessage
			select {
			case <-ctx.Done():
				_ = stream.CloseRequest()
				return
			case <-t.C:
				m = &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}}
			case m = <-out:
			}
			if err := stream.Send(m); err != nil {
				cancel(fmt.Errorf("send: %w", err))
				return
			}
		}
	}()
	// Notice a renewal: the identity on disk has another serial.
	go func() {
		t := time.NewTicker(d.cfg.IdentityCheck)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				cur, err := d.cfg.Store.Load()
				if err == nil && cur.Serial != id.Serial {
					cancel(errIdentityChanged)
					return
				}
			}
		}
	}()
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
		go func() {
			res := d.command(ctx, id, sc)
			select {
			case out <- &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: res}}:
			case <-ctx.Done():
			}
		}()
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
	RefusedSignature = "signature"
	RefusedNode      = "node"
	RefusedExpired   = "expired"
	RefusedMalformed = "malformed"
)

// Verify checks a signed command as bcd does before running it: the
// signature under a key of the command-signing bundle (purpose command),
// this node's id, and the expiry at now. It returns the body (as far as it
// parsed) and, when refused, the reason.
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
	case now.UnixMilli() >= body.GetExpiresAtUnixMs():
		return body, RefusedExpired
	}
	return body, ""
}

// command verifies and runs one command.
func (d *Daemon) command(ctx context.Context, id *identity.Identity, sc *agentv1.SignedCommand) *agentv1.CommandResult {
	body, refused := Verify(id, sc, d.clock.Now())
	res := &agentv1.CommandResult{CommandId: body.GetCommandId()}
	if refused != "" {
		d.log.Warn("command refused", "command", body.GetCommandId(), "kind", body.GetKind(), "reason", refused)
		res.Error = refused
		return res
	}
	out, err := Execute(ctx, d.cfg.BCD.ProcfsRoot, body.GetKind(), body.GetArgs())
	if err != nil {
		res.Error = err.Error()
		return res
	}
	res.Ok, res.Output = true, out
	d.log.Info("command done", "command", body.GetCommandId(), "kind", body.GetKind())
	return res
}
