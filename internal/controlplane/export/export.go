// Package export ships the event stream and the audit log of every tenant
// to external sinks (a webhook, a file or stdout), for a SIEM (R17.4).
//
// Delivery is at least once, with each item's id (the ev_…/au_… id the API
// lists it under) as its idempotency key: a sink that keeps one copy per id
// ends with every row exactly once, across restarts and replicas.
//
//   - One API replica exports at a time: it holds the export lease in the
//     database (store, exportpos.go), renewed every third of its term;
//     another replica takes it over once it expired.
//   - Each sink has its own position in the database: the global position
//     (not a tenant's cursor) after the last event and audit row the sink
//     acknowledged. It is written only after the sink acknowledged (a 2xx
//     answer; a file's fsync) and only by the lease's holder, so a restart
//     or a takeover resumes where the sink left off and resends at most the
//     batch in flight.
//   - A batch the sink refuses, or that times out, is sent again, from the
//     same position, after a backoff (internal/shared/backoff).
//
// Items carry the event or audit row as the API's ListEvents and ListAudit
// answer it (api.EventPB, api.AuditPB), so a sink sees the same ids and
// fields as a client.
//
// Importers: internal/controlplane/server.
package export

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// Config is the [export] section of better-compute serve's configuration,
// and what New needs besides.
type Config struct {
	// Sinks are where rows go; none turns export off.
	Sinks []SinkConfig `toml:"sinks"`
	// BatchSize bounds the events and, as many again, the audit rows of one
	// batch (default 500).
	BatchSize int `toml:"batch_size"`
	// Interval is how often a caught-up sink looks for new rows (default
	// 1s); an event committed on this replica wakes it at once.
	Interval time.Duration `toml:"interval"`
	// Lease is the export lease's term (default 15s): how long exports stop
	// when the replica holding it dies.
	Lease time.Duration `toml:"lease"`

	DB     *store.DB     `toml:"-"`
	Codec  *events.Codec `toml:"-"`
	Hub    *events.Hub   `toml:"-"` // optional: wakes sinks at commits
	Clock  clock.Clock   `toml:"-"`
	Log    *slog.Logger  `toml:"-"`
	Holder string        `toml:"-"` // this replica's lease holder id; default random
	// Retry is the backoff between attempts at a batch (default 500ms
	// doubling to 30s).
	Retry backoff.Policy `toml:"-"`
	// Metrics, when set, registers the rows exported, the failed
	// deliveries and the lag of each sink (telemetry.Export*).
	Metrics prometheus.Registerer `toml:"-"`
}

// Exporter runs the sinks while it holds the lease.
type Exporter struct {
	cfg   Config
	sinks []*sink
	held  atomic.Bool
	m     *metrics
}

// sink is one configured sink and its delivery.
type sink struct {
	name          string
	events, audit bool
	deliver       func(ctx context.Context, items []Item) error
	// oldest is when the oldest row the sink has not acknowledged was
	// written (unix nanoseconds), 0 when it was caught up at its last
	// look.
	oldest atomic.Int64
}

// New checks cfg and builds its sinks.
func New(cfg Config) (*Exporter, error) {
	if cfg.DB == nil || cfg.Codec == nil {
		return nil, errors.New("export: a store and a cursor codec are required")
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Lease <= 0 {
		cfg.Lease = 15 * time.Second
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Holder == "" {
		cfg.Holder = ids.New("exp", cfg.Clock.Now())
	}
	if cfg.Retry.Min <= 0 {
		cfg.Retry = backoff.Policy{Min: 500 * time.Millisecond, Max: 30 * time.Second, Jitter: backoff.DefaultJitter}
	}
	sinks, err := buildSinks(cfg.Sinks, cfg.Log)
	if err != nil {
		return nil, err
	}
	e := &Exporter{cfg: cfg, sinks: sinks, m: newMetrics()}
	if cfg.Metrics != nil {
		for _, s := range sinks {
			// Every sink's series exist from the start, at 0.
			e.m.errors.WithLabelValues(s.name)
			e.m.rows.WithLabelValues(s.name, KindEvent)
			e.m.rows.WithLabelValues(s.name, KindAudit)
		}
		if err := errors.Join(cfg.Metrics.Register(e.m.rows), cfg.Metrics.Register(e.m.errors), cfg.Metrics.Register(lagCollector{e})); err != nil {
			return nil, fmt.Errorf("export: register metrics: %w", err)
		}
	}
	return e, nil
}

// Check reports what New would refuse in the sinks of cfg (a config file
// is checked when it is loaded).
func Check(cfg Config) error {
	_, err := buildSinks(cfg.Sinks, slog.New(slog.DiscardHandler))
	return err
}

func buildSinks(cfgs []SinkConfig, log *slog.Logger) ([]*sink, error) {
	var out []*sink
	seen := map[string]bool{}
	for i, sc := range cfgs {
		s, err := newSink(sc, log)
		if err != nil {
			return nil, fmt.Errorf("export.sinks[%d]: %w", i, err)
		}
		if seen[s.name] {
			return nil, fmt.Errorf("export.sinks[%d]: a second sink named %q (give each a name)", i, s.name)
		}
		seen[s.name] = true
		out = append(out, s)
	}
	return out, nil
}

// Holding reports whether this exporter holds the lease.
func (e *Exporter) Holding() bool { return e.held.Load() }

// Run exports until ctx ends, then gives the lease up.
func (e *Exporter) Run(ctx context.Context) {
	if len(e.sinks) == 0 {
		return
	}
	done := make(chan struct{})
	for _, s := range e.sinks {
		go func() { defer func() { done <- struct{}{} }(); e.runSink(ctx, s) }()
	}
	e.runLease(ctx)
	for range e.sinks {
		<-done
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := e.cfg.DB.WithTx(rctx, func(tx *store.Tx) error {
		return tx.ReleaseExportLease(rctx, store.ExportLease, e.cfg.Holder)
	}); err != nil {
		e.cfg.Log.Warn("export: release the lease", "err", err)
	}
}

// runLease takes and renews the lease every third of its term.
func (e *Exporter) runLease(ctx context.Context) {
	for {
		var ok bool
		err := e.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
			var err error
			ok, err = tx.TakeExportLease(ctx, store.ExportLease, e.cfg.Holder, e.cfg.Lease)
			return err
		})
		if err != nil && ctx.Err() == nil {
			e.cfg.Log.Warn("export: renew the lease", "err", err)
		}
		if was := e.held.Swap(err == nil && ok); was != (err == nil && ok) {
			e.cfg.Log.Info("export lease", "held", !was, "holder", e.cfg.Holder)
		}
		if !clock.Sleep(e.cfg.Clock, ctx.Done(), e.cfg.Lease/3) {
			e.held.Store(false)
			return
		}
	}
}

// runSink delivers the sink's batches while the lease is held.
func (e *Exporter) runSink(ctx context.Context, s *sink) {
	failures := 0
	for ctx.Err() == nil {
		var wake <-chan struct{}
		if e.cfg.Hub != nil {
			wake = e.cfg.Hub.Wait()
		}
		wait := e.cfg.Interval
		if e.held.Load() {
			more, err := e.pump(ctx, s)
			switch {
			case err != nil && ctx.Err() == nil:
				failures++
				e.m.errors.WithLabelValues(s.name).Inc()
				wait = e.cfg.Retry.Spread(failures, rand.Float64())
				e.cfg.Log.Warn("export: deliver", "sink", s.name, "err", err, "failures", failures, "retry_in", wait)
				wake = nil
			case more:
				failures = 0
				continue
			default:
				failures = 0
			}
		}
		t := e.cfg.Clock.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-t.C():
		case <-wake:
		}
		t.Stop()
	}
}

// pump sends the sink one batch from its committed position and commits
// the position after it once the sink acknowledged. more is true when the
// batch was full.
func (e *Exporter) pump(ctx context.Context, s *sink) (more bool, err error) {
	var pos store.ExportPosition
	var evs []store.Event
	var aus []store.ExportAudit
	n := e.cfg.BatchSize
	err = e.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		if pos, err = tx.ReadExportPosition(ctx, s.name); err != nil {
			return err
		}
		if s.events {
			if evs, err = tx.ExportEvents(ctx, pos.EventOrder, pos.EventID, n); err != nil {
				return err
			}
		}
		if s.audit {
			aus, err = tx.ExportAuditRows(ctx, pos.AuditOrder, pos.AuditID, n)
		}
		return err
	})
	if err != nil {
		return false, err
	}
	s.oldest.Store(oldest(evs, aus))
	if len(evs)+len(aus) == 0 {
		return false, nil
	}
	items, next, err := e.items(pos, evs, aus)
	if err != nil {
		return false, err
	}
	if err := s.deliver(ctx, items); err != nil {
		return false, err
	}
	e.m.rows.WithLabelValues(s.name, KindEvent).Add(float64(len(evs)))
	e.m.rows.WithLabelValues(s.name, KindAudit).Add(float64(len(aus)))
	// Committed even when ctx ended meanwhile (a clean stop): the sink has
	// the batch, and a position left behind would only resend it.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err = e.cfg.DB.WithTx(cctx, func(tx *store.Tx) error {
		return tx.CommitExportPosition(cctx, store.ExportLease, e.cfg.Holder, s.name, next)
	})
	e.cfg.Log.Debug("export: batch", "sink", s.name, "holder", e.cfg.Holder, "from", pos, "to", next, "items", len(items), "err", err)
	if errors.Is(err, store.ErrExportLeaseLost) {
		// Another replica took over: it resends from the last position
		// committed, so this batch may reach the sink twice (same ids).
		e.held.Store(false)
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("commit the position of %s: %w", s.name, err)
	}
	more = len(evs) == n || len(aus) == n
	if !more {
		s.oldest.Store(0) // caught up, as of this batch's read
	}
	return more, nil
}

// oldest is when the earliest of a batch's rows was written (unix
// nanoseconds), 0 for an empty batch. Rows come in commit order, so the
// first of each kind is its oldest.
func oldest(evs []store.Event, aus []store.ExportAudit) int64 {
	var t time.Time
	if len(evs) > 0 {
		t = evs[0].CreatedAt
	}
	if len(aus) > 0 && (t.IsZero() || aus[0].CreatedAt.Before(t)) {
		t = aus[0].CreatedAt
	}
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func timeOf(nanos int64) time.Time { return time.Unix(0, nanos) }
