package run

import (
	"context"
	"errors"
	"log/slog"
	"net"

	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/diag"
	"github.com/better-compute/better-compute/internal/node/doctor"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// ProcessConfig is what `bcd run` is started with: its configuration and
// its environment. bcd's command and the tests build a Process from it.
type ProcessConfig struct {
	// BCD is the loaded config.toml (its data_dir already overridden by
	// --data-dir); ConfigPath is its file, where learned pins are saved.
	BCD        *bcdconfig.Config
	ConfigPath string
	// Log receives the daemon's lines; Clock is its time (nil: the wall
	// clock).
	Log   *slog.Logger
	Clock clock.Clock
	// HTTPClient makes every HTTP client toward the gateway (traced when
	// tracing is on); nil: enroll's default.
	HTTPClient enroll.HTTPClientFunc
	// NotifySocket is $NOTIFY_SOCKET (systemd); "" sends nothing.
	NotifySocket string
	// DiagReady, when set, receives the diagnostics listener's address.
	DiagReady func(addr string)
	// OnWelcome, when set, is called after each Welcome (tests).
	OnWelcome func(nodeID string)
}

// Process is `bcd run`: the session loop (Daemon), the certificate
// renewer, the re-join of an expired identity and the diagnostics
// listener, sharing one identity, one pin set, one TLS ticket cache and
// one offset from the control plane's clock. Build it with NewProcess.
type Process struct {
	daemon *Daemon
	diag   *diag.Diag
	ln     net.Listener // the diagnostics listener; nil when none
	store  *identity.Store
	cfg    ProcessConfig
}

// NewProcess wires bcd run from c. The diagnostics listener is opened
// here, so a config error comes before anything runs.
func NewProcess(c ProcessConfig) (*Process, error) {
	if c.Clock == nil {
		c.Clock = clock.Real{}
	}
	if c.HTTPClient == nil {
		c.HTTPClient = enroll.DefaultHTTPClient
	}
	cfg, log := c.BCD, c.Log
	keys, store, err := tpmkeys.Stores(cfg, cfg.DataDir)
	if err != nil {
		return nil, err
	}
	// R17.2: /livez, /readyz and /metrics when [diagnostics] listen is
	// set; the renewer's and session's hooks feed it. One offset from the
	// control plane's clock for the renewer, the session and the
	// diagnostics (R19.3).
	serverTime := servertime.New(servertime.Config{Dir: store.Dir, Clock: c.Clock})
	dg := diag.New(store, serverTime.Now)
	// A renewal tells the session at once (R19.3); a renewal the session
	// has not taken yet is enough, so the channel holds one.
	renewed := make(chan struct{}, 1)
	// One live pin set for the renewer and the session (R16.2): a key
	// either learns is saved to config.toml and used by both.
	pins := config.NewPins(c.ConfigPath, cfg, log)
	// One TLS ticket cache too: a renewal resumes the session's TLS
	// session with the gateway (same identity, same gateway).
	tickets := &enroll.TicketCache{}
	// And the session's connection: a renewal is a call on it, not a
	// second TLS connection, while the session is up on the certificate
	// renewed.
	conn := &renew.SessionConn{}
	r, err := renew.New(renew.Config{BCD: cfg, Store: store, Keys: keys, Clock: c.Clock, ServerTime: serverTime, HTTPClient: c.HTTPClient, Log: log, Pins: pins, Tickets: tickets,
		Session: conn,
		OnRenewed: func(id *identity.Identity) {
			dg.Renewed(id)
			select {
			case renewed <- struct{}{}:
			default:
			}
		},
		OnFailed: dg.RenewalFailed})
	if err != nil {
		return nil, err
	}
	// R21.5: an expired certificate re-joins by x509pop by itself.
	rejoin := func(ctx context.Context) (*identity.Identity, error) {
		j, err := enroll.New(enroll.Config{BCD: cfg, ConfigPath: c.ConfigPath, Store: store, Keys: keys, Clock: c.Clock,
			HTTPClient: c.HTTPClient, Log: log, ServerTime: serverTime, Pins: pins,
			Progress: func(line string) { log.Info(line) }})
		if err != nil {
			return nil, err
		}
		return j.Join(ctx, enroll.Options{Attestor: identity.AttestorX509Pop})
	}
	onWelcome := dg.Welcomed
	if c.OnWelcome != nil {
		onWelcome = func(nodeID string) { dg.Welcomed(nodeID); c.OnWelcome(nodeID) }
	}
	d, err := New(Config{BCD: cfg, Store: store, Clock: c.Clock, ServerTime: serverTime, Log: log, Renewer: r, Renewed: renewed, NotifySocket: c.NotifySocket,
		Pins: pins, Tickets: tickets, SessionConn: conn, OnWelcome: onWelcome, OnSessionEnded: dg.SessionEnded, Rejoin: rejoin})
	if err != nil {
		return nil, err
	}
	ln, err := dg.Listen(cfg.Diagnostics)
	if err != nil {
		return nil, err
	}
	return &Process{daemon: d, diag: dg, ln: ln, store: store, cfg: c}, nil
}

// Run runs the daemon (with its renewer) and the diagnostics listener
// until ctx ends or the daemon stops, and returns once every goroutine it
// started has. ErrRetired (wrapped) says the control plane retired the
// node; it is recorded for bcd doctor.
func (p *Process) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	if p.ln != nil {
		g.Go(func() error { return p.diag.Serve(gctx, p.ln, p.cfg.Log, p.cfg.DiagReady) })
	}
	var daemonErr error
	g.Go(func() error {
		daemonErr = p.daemon.Run(gctx)
		// The daemon stopped (ctx ended, or it cannot go on): so does
		// the rest.
		return errDaemonStopped
	})
	if err := g.Wait(); !errors.Is(err, errDaemonStopped) {
		return err // the diagnostics listener failed
	}
	if errors.Is(daemonErr, ErrRetired) {
		// For bcd doctor: only a session learns of it.
		if id, lerr := p.store.Load(); lerr == nil {
			if werr := doctor.RecordRetired(p.store.Dir, id, p.cfg.Clock.Now()); werr != nil {
				p.cfg.Log.Warn("cannot record the retirement for bcd doctor", telemetry.LogErr, werr)
			}
		}
	}
	return daemonErr
}

// errDaemonStopped ends the process's other tasks once the daemon returned.
var errDaemonStopped = errors.New("the daemon stopped")
