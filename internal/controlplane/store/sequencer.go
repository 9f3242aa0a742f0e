package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// The event sequencer (PostgreSQL only).
//
// A reader pages through a tenant's events with a cursor, so an event must
// never become readable at a position before one a reader may already have
// passed. Ids (and transaction ids) are handed out when rows are written,
// not when they commit, so on their own they do not give that: a
// transaction that took id 10 can commit after one that took id 11 was
// read. The first design hid every event newer than the oldest running
// transaction of the cluster (pg_snapshot_xmin); any long transaction, in
// any database of the cluster, stalled every tenant's stream.
//
// Instead, events are written unsequenced (tx_order NULL, invisible to
// readers) and a sequencer gives them their position after they committed.
// A pass takes the one event_sequencer row's lock, so passes run one at a
// time across every API replica; then, in a new statement whose snapshot
// sees every earlier pass, it numbers the committed unsequenced events: one
// tx_order per writing transaction, above every number given before, and
// commits. A reader's snapshot therefore sees a prefix of the passes, and
// within it every event with a lower position than any it sees: the cursor
// (tx_order, id) never skips or repeats an event. A transaction that
// committed before another began comes first (it is in the same or an
// earlier pass, and in the same pass has the lower transaction id); a
// transaction's events stay together, in the order written.
//
// Nothing outside the sequencer can hold it up: a pass only waits for an
// earlier pass, it reads only committed rows, and it runs as one simple
// query, so no client holds the lock between round trips. Uncommitted or
// abandoned transactions, here or in any other database of the cluster,
// are never waited for.
//
// Who runs it: every API process. A commit that inserted events kicks its
// process's sequencer, which runs a pass at once (passes coalesce: one pass
// numbers every event committed before it began) and then runs the
// transaction's AfterEventsVisible hooks, which wake long-poll readers.
// Each process also sweeps every second, so events of a process that died
// between its commit and its pass are numbered by the survivors, or by the
// next start.
//
// Alternatives considered: a per-tenant counter row taken at the end of each
// writing transaction gives exact commit order without a second write, but
// every event-publishing transaction of a tenant then queues on that row
// from the counter update to the end of its COMMIT; a rack of joins is one
// tenant, and the same queue on a token row was measured at 142-159 joins/s
// (docs/contributors/performance.md). The sequencer costs one extra UPDATE
// per event, off the join's path.

// sweepInterval is how often each process looks for events no sequencer
// numbered (a writer that died after its commit, an older replica).
const sweepInterval = time.Second

// passTimeout bounds one pass.
const passTimeout = 10 * time.Second

// passRetry spaces the passes after one failed. The sequencers of every
// replica fail together when the database does, so their waits are
// spread; the store has no injected clock (the engine's retries wait on
// the real one too).
var passRetry = backoff.Policy{Min: 50 * time.Millisecond, Max: time.Second, Jitter: backoff.DefaultJitter}

// passSQL is one pass, sent as one simple query (no arguments), which
// PostgreSQL runs as one transaction with a new snapshot per statement. It
// numbers at most 1000 transactions, so that a backlog is taken in several
// short passes.
//
// It sets its own isolation and durability, whatever the database's
// defaults: READ COMMITTED, so that the numbering statement's snapshot is
// taken after the lock is held; synchronous commit, because a pass that
// readers saw and a crash then lost would be done again with other numbers.
const passSQL = `SET LOCAL transaction_isolation = 'read committed';
SET LOCAL synchronous_commit = on;
SELECT last FROM event_sequencer WHERE id = 1 FOR UPDATE;
WITH w AS (
	SELECT writer_xid, row_number() OVER (ORDER BY writer_xid) AS n
	FROM (SELECT DISTINCT writer_xid FROM events WHERE tx_order IS NULL ORDER BY writer_xid LIMIT 1000) p
), numbered AS (
	UPDATE events e SET tx_order = s.last + w.n
	FROM w, event_sequencer s
	WHERE s.id = 1 AND e.tx_order IS NULL AND e.writer_xid = w.writer_xid
	RETURNING e.tx_order
)
UPDATE event_sequencer SET last = GREATEST(last, (SELECT COALESCE(MAX(tx_order), 0) FROM numbered)) WHERE id = 1`

type sequencer struct {
	db   *DB
	kick chan struct{}
	quit chan struct{}
	done chan struct{}

	mu sync.Mutex
	// hooks wait for the next pass that begins after they were added.
	hooks []func()
}

func newSequencer(db *DB) *sequencer {
	return &sequencer{db: db, kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
}

// committed is called after a commit that inserted events, with the
// transaction's AfterEventsVisible hooks.
func (s *sequencer) committed(hooks []func()) {
	if len(hooks) > 0 {
		s.mu.Lock()
		s.hooks = append(s.hooks, hooks...)
		s.mu.Unlock()
	}
	s.poke()
}

func (s *sequencer) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

func (s *sequencer) stop() {
	close(s.quit)
	<-s.done
}

func (s *sequencer) run() {
	defer close(s.done)
	tick := time.NewTicker(sweepInterval)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-s.quit:
			return
		case <-s.kick:
		case <-tick.C:
		}
		s.mu.Lock()
		hooks := s.hooks
		s.hooks = nil
		s.mu.Unlock()
		if err := s.sequence(); err != nil {
			failures++
			s.db.log.Warn("event sequencer", "err", err, "failures", failures)
			// The hooks wait for a pass that succeeds; try again soon.
			s.mu.Lock()
			s.hooks = append(hooks, s.hooks...)
			s.mu.Unlock()
			if !clock.Sleep(clock.Real{}, s.quit, passRetry.Spread(failures, rand.Float64())) {
				return
			}
			s.poke()
			continue
		}
		failures = 0
		for _, f := range hooks {
			s.db.e.Safely("events-visible hook", f)
		}
	}
}

// sequence runs passes until no committed event is left unnumbered.
func (s *sequencer) sequence() error {
	ctx, cancel := context.WithTimeout(context.Background(), passTimeout)
	defer cancel()
	for {
		// Looking is a cheap read (a partial index of the unnumbered);
		// a pass writes, so it runs only when there is work.
		var pending bool
		if err := s.db.e.Pool().QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM events WHERE tx_order IS NULL)").Scan(&pending); err != nil {
			return fmt.Errorf("look for unsequenced events: %w", err)
		}
		if !pending {
			return nil
		}
		if _, err := s.db.e.Pool().ExecContext(ctx, passSQL); err != nil {
			return fmt.Errorf("sequence events: %w", err)
		}
	}
}

// SequenceEvents makes every event committed so far readable and returns
// when it is (PostgreSQL; SQLite events are readable at commit).
func (db *DB) SequenceEvents(ctx context.Context) error {
	if db.seq == nil {
		return nil
	}
	done := make(chan struct{})
	db.seq.committed([]func(){func() { close(done) }})
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
