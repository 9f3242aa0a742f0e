package session

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Listener defaults.
const (
	// DefaultPingEvery: a listening connection silent this long is pinged.
	DefaultPingEvery = 30 * time.Second
	// DefaultMinBackoff and DefaultMaxBackoff bound the wait before the
	// listener connects again; it doubles with each failure in a row.
	DefaultMinBackoff = 250 * time.Millisecond
	DefaultMaxBackoff = 30 * time.Second
	// connectTimeout bounds one connect (and LISTEN), and one ping.
	connectTimeout = 10 * time.Second
	// scanLimit bounds the nodes one scan of the queue wakes; the poll
	// finds the rest.
	scanLimit = 10000
)

// ListenerConfig lists the Listener's dependencies.
type ListenerConfig struct {
	DB    *store.DB
	Clock clock.Clock
	Log   *slog.Logger
	// Notify is told each node with newly queued commands: the session
	// service's Notify.
	Notify func(nodeID string)
	// PingEvery is how long the connection may stay silent before it is
	// pinged (default 30 s): a connection that broke without a TCP reset
	// would otherwise wait forever while notifications went to nobody.
	PingEvery time.Duration
	// MinBackoff and MaxBackoff bound the wait before connecting again
	// (defaults 250 ms and 30 s).
	MinBackoff, MaxBackoff time.Duration
}

// ListenerStatus is what the listener is doing (tests, diagnostics).
type ListenerStatus struct {
	// Listening is true once a connection LISTENs and the queue was
	// scanned after it, until that connection is lost.
	Listening bool
	// Connects counts the connections that reached Listening.
	Connects int
	// BackendPID is the listening connection's pg_stat_activity.pid (0
	// when not listening).
	BackendPID uint32
}

// Listener brings commands queued on other replicas to the sessions of
// this one (PostgreSQL): it holds one dedicated connection that LISTENs
// on the store's commands channel and hands each notified node id to
// Notify. Notifications sent while it is not listening are lost, so every
// time it (re)connects it scans the whole queue once, after LISTEN, so
// that nothing queued before or during the scan is missed. A lost
// connection is reconnected with backoff. On SQLite there is one process:
// Run returns at once, and writers call Notify in-process.
type Listener struct {
	cfg ListenerConfig

	mu     sync.Mutex
	status ListenerStatus
}

// NewListener returns a Listener; Run runs it.
func NewListener(cfg ListenerConfig) *Listener {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Notify == nil {
		cfg.Notify = func(string) {}
	}
	if cfg.PingEvery <= 0 {
		cfg.PingEvery = DefaultPingEvery
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = DefaultMinBackoff
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(DefaultMaxBackoff, cfg.MinBackoff)
	}
	return &Listener{cfg: cfg}
}

// Status reports what the listener is doing.
func (l *Listener) Status() ListenerStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.status
}

// Run listens until ctx ends; on SQLite it returns at once.
func (l *Listener) Run(ctx context.Context) {
	if !l.cfg.DB.CanListen() {
		return
	}
	failures := 0
	for {
		listened, err := l.listen(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			failures = 0
		}
		failures++
		wait := l.backoff(failures)
		l.cfg.Log.Warn("command notifications: connection lost; commands queued on other replicas reach this one's sessions by the poll until it is back",
			"err", err, "retry_in", wait)
		if !clock.Sleep(l.cfg.Clock, ctx.Done(), wait) {
			return
		}
	}
}

// backoff is the wait before attempt n (1-based) after a failure.
func (l *Listener) backoff(n int) time.Duration {
	return backoff.Policy{Min: l.cfg.MinBackoff, Max: l.cfg.MaxBackoff}.Delay(n)
}

// bounded returns ctx ended after d on the injected clock as well.
func (l *Listener) bounded(ctx context.Context, d time.Duration) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	t := l.cfg.Clock.AfterFunc(d, cancel)
	return ctx, func() { t.Stop(); cancel() }
}

// listen connects, LISTENs, scans the queue, and then hands notifications
// to Notify until the connection fails or ctx ends. It reports whether it
// got as far as listening.
func (l *Listener) listen(ctx context.Context) (bool, error) {
	cctx, done := l.bounded(ctx, connectTimeout)
	ln, err := l.cfg.DB.ListenCommands(cctx)
	done()
	if err != nil {
		return false, err
	}
	defer func() { _ = ln.Close(context.WithoutCancel(ctx)) }()
	// After LISTEN, not before: a command that commits once LISTEN took
	// effect is notified, and one that committed earlier is in the scan's
	// snapshot, so none falls between the two.
	if err := l.scan(ctx); err != nil {
		return false, err
	}
	l.mu.Lock()
	l.status.Listening, l.status.BackendPID = true, ln.PID()
	l.status.Connects++
	n := l.status.Connects
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.status.Listening, l.status.BackendPID = false, 0
		l.mu.Unlock()
	}()
	if n == 1 {
		l.cfg.Log.Info("command notifications: listening", "channel", l.cfg.DB.CommandsChannel(), "pid", ln.PID())
	} else {
		l.cfg.Log.Info("command notifications: listening again", "channel", l.cfg.DB.CommandsChannel(), "pid", ln.PID())
	}
	for {
		wctx, done := l.bounded(ctx, l.cfg.PingEvery)
		nodeID, err := ln.Next(wctx)
		quiet := wctx.Err() != nil
		done()
		switch {
		case err == nil:
			l.cfg.Notify(nodeID)
		case ctx.Err() != nil:
			return true, nil
		case quiet:
			pctx, done := l.bounded(ctx, connectTimeout)
			err := ln.Ping(pctx)
			done()
			if err != nil {
				return true, err
			}
		default:
			return true, err
		}
	}
}

// scan wakes every node with queued commands.
func (l *Listener) scan(ctx context.Context) error {
	var nodes []string
	if err := l.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		nodes, err = tx.NodesWithQueuedCommands(ctx, scanLimit)
		return err
	}); err != nil {
		return err
	}
	for _, id := range nodes {
		l.cfg.Notify(id)
	}
	return nil
}
