package engine

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Outages (R19.1). A database that is down, restarting, read-only or out
// of space answers UNAVAILABLE (unavailable.go). Two things follow here:
//   - A write transaction waits for it: WithTx runs fn again, spaced by
//     outageRetry, for up to Config.OutageWait (2 s by default), so a
//     PostgreSQL restart or failover costs a join or renewal latency, not a
//     failure. Only failures that certainly did not apply fn wait: a
//     commit whose outcome is unknown (ErrCommitUnknown) never runs again
//     here (the join core retries those itself, idempotently), nor does a
//     closed database (the process is stopping).
//   - Readiness fails while writes fail (CheckWrites), not only reads.

// DefaultOutageWait is how long a write waits for the database when
// Config.OutageWait is 0.
const DefaultOutageWait = 2 * time.Second

// outageRetry spaces the attempts of a write while the database is out.
var outageRetry = backoff.Policy{Min: 50 * time.Millisecond, Max: 400 * time.Millisecond}

// probeFor is how long CheckWrites keeps its probe's answer: a hot
// /readyz (every gateway checks every replica four times a second) costs
// at most one write a second.
const probeFor = time.Second

// failedWritesFor is how long a write that failed for an outage keeps
// readiness failing when no write succeeded since (see CheckWrites).
const failedWritesFor = 5 * time.Second

func (c Config) outageWait() time.Duration {
	switch {
	case c.OutageWait < 0:
		return 0
	case c.OutageWait == 0:
		return DefaultOutageWait
	}
	return c.OutageWait
}

// waitable reports whether err is the database's own failure that left
// nothing applied, so running the transaction again is safe.
func waitable(err error) bool {
	if err == nil || errors.Is(err, ErrCommitUnknown) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, ErrClosed) || strings.Contains(err.Error(), "sql: database is closed") {
		return false
	}
	return UnavailableReason(err) != ""
}

// withOutageWait runs run, and again while it fails waitable, for up to
// wait or until ctx ends; it records the outcome for CheckWrites.
func (db *DB) withOutageWait(ctx context.Context, wait time.Duration, run func() error) error {
	err := run()
	if waitable(err) && wait > 0 {
		deadline := time.Now().Add(wait)
		for n := 1; waitable(err) && ctx.Err() == nil; n++ {
			left := time.Until(deadline)
			if left <= 0 {
				break
			}
			db.log.Debug("database unavailable: waiting to retry the transaction", "attempt", n, "err", err)
			if !clock.Sleep(clock.Real{}, ctx.Done(), min(outageRetry.Delay(n), left)) {
				break
			}
			err = run()
		}
	}
	db.probe.wrote(err)
	return err
}

// writeProbe is what CheckWrites knows: its last probe, and the last
// outcomes of the other writes.
type writeProbe struct {
	// running serializes the probes; mu guards the fields (never held
	// during a write, which records its outcome here).
	running  sync.Mutex
	mu       sync.Mutex
	at       time.Time // of the probe
	err      error     // the probe's
	okAt     time.Time // the last write that committed
	failedAt time.Time // the last write that failed for an outage
	failed   error
}

// wrote records a write's outcome (nil: it committed).
func (p *writeProbe) wrote(err error) {
	if err != nil && !waitable(err) {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err == nil {
		p.okAt = time.Now()
	} else {
		p.failedAt, p.failed = time.Now(), err
	}
}

// CheckWrites reports whether the database takes writes now (readiness,
// R19.1): a database can answer reads while it refuses every write. It
// fails when its probe (one row rewritten in ready_probe, at most every
// probeFor) fails, and while the last write failed for an outage less
// than failedWritesFor ago with none committed since: a full SQLite disk
// may still take the probe's one page (the write-ahead log reuses its
// space) while it refuses a join. The error is UNAVAILABLE naming the
// reason (UnavailableReason).
func (db *DB) CheckWrites(ctx context.Context) error {
	p := &db.probe
	p.running.Lock()
	defer p.running.Unlock()
	p.mu.Lock()
	due := p.at.IsZero() || time.Since(p.at) >= probeFor
	p.mu.Unlock()
	if due {
		now := time.Now()
		err := db.withTx(ctx, func(tx *Tx) error {
			_, err := tx.Exec(ctx, "INSERT INTO ready_probe (id, at_ms) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at_ms = excluded.at_ms", now.UnixMilli())
			return err
		})
		if err != nil && ctx.Err() != nil {
			return err // the caller left: no answer to keep
		}
		p.mu.Lock()
		p.at, p.err = now, err
		p.mu.Unlock()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	if p.failedAt.After(p.okAt) && time.Since(p.failedAt) < failedWritesFor {
		return p.failed
	}
	return nil
}
