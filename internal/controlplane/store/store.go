// Package store owns the database: every SQL statement the control plane
// runs, the migrations of each dialect (migrations/sqlite,
// migrations/postgres) and the compute_now() clock. Domain packages
// (tenancy, jointoken, join, events) decide; they reach the database only
// through the typed methods of Tx inside DB.WithTx (writes), DB.ReadTx
// (reads, always rolled back) or DB.ReadLatest.
//
// How statements run is the engine's (store/engine): opening SQLite or
// PostgreSQL, migrating, transactions and their truthful outcome, SQLite's
// group commit and checkpoints, PostgreSQL's pipelined writes, the per-dialect
// SQL rewrite, outages. This package writes the SQL once, with ?
// placeholders and compute_now(), and runs it through the engine's Tx
// (Tx.exec, Tx.query, Tx.queryRow, and Tx.execLater for inserts whose
// result nothing reads before the commit). storetest holds the conformance
// suite that runs against both dialects.
//
// Files: store.go (opening, DB, Tx, the clock), helpers.go (ErrNotFound,
// value conversions), multirow.go (multi-row INSERTs), sequencer.go
// (PostgreSQL events numbered after they commit, so no foreign
// transaction can stall a stream), notify.go (command notifications),
// backup.go (online SQLite snapshots, schema versions, a restore's token
// revocations). The tables, one file each or a few:
//   - tenancy.go (tenants, sites, pools), poollock.go, apikeys.go,
//     limits.go (rate-limit counters), streamkey.go (the cursor-sealing key);
//   - joining: jointokens.go; joinrequests.go and joinrequestlimits.go;
//     joinanswers.go; pkikeys.go; tpmaks.go;
//   - nodes: nodes.go (nodes rows), nodecerts.go (node_certs: issuing,
//     reading, superseding, revoking), nodeauthz.go (the authorization
//     projection), renew.go (renewal proofs), sessions.go (a node's
//     connection), sessionstate.go (what replicas holding sessions read and
//     put back), sessionchanges.go (the session change feed: which nodes
//     changed, written by triggers, read by every replica);
//   - commands.go and commandlist.go (commands, and listing them);
//     workqueue.go (the controllers' work queue) and workowners.go (its
//     owner leases and owned claims);
//   - events.go, audit.go, exportpos.go (the export lease, sinks' positions
//     and the reads across tenants).
//
// The engine's guarantees are tested here, through the typed methods and
// the real schema: groupcommit_test.go, writerconn_test.go, commit_test.go,
// pipeline_test.go, checkpoint_test.go, outage_test.go,
// unavailable_test.go, rewritedb_test.go; BenchmarkTx (bench_test.go)
// measures the smallest read and write transaction of each dialect.
//
// Importers: domain packages and the API (through DB, Tx and their typed
// methods), mains and tests. The gateway and bcd never import it.
package store

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"io/fs"
	"log/slog"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store/engine"
)

//go:embed migrations
var migrations embed.FS

// Dialect names a supported database.
type Dialect = engine.Dialect

// The supported databases.
const (
	SQLite   = engine.SQLite
	Postgres = engine.Postgres
)

// Config says which database to open.
type Config struct {
	// Driver is "sqlite" (default) or "postgres".
	Driver string `toml:"driver"`
	// Path is the SQLite database file (sqlite only).
	Path string `toml:"path"`
	// DSN is the PostgreSQL connection string (postgres only), e.g.
	// "postgres://user@host:5432/db?sslmode=verify-full".
	DSN string `toml:"dsn"`
	// MaxConns bounds PostgreSQL connections (default 16).
	MaxConns int `toml:"max_conns"`
	// OutageWait is how long a write transaction waits for a database that
	// is down, read-only or full to take writes again before it answers
	// UNAVAILABLE, e.g. "2s" (the default); "-1s" answers at once (R19.1,
	// engine/outage.go).
	OutageWait time.Duration `toml:"outage_wait"`

	// busyTimeout is how long SQLite waits for a lock another process
	// holds (default 10 s); tests shorten it.
	busyTimeout time.Duration
	// checkpointPages and checkpointEvery override when the checkpointer
	// runs (engine/checkpoint.go); tests set them.
	checkpointPages int64
	checkpointEvery time.Duration
}

// DefaultOutageWait is how long a write waits for the database when
// Config.OutageWait is 0.
const DefaultOutageWait = engine.DefaultOutageWait

// ErrClosed answers a write that comes after Close began: the server is
// stopping, and another replica, or this one restarted, takes the retry.
var ErrClosed = engine.ErrClosed

// DB is an open, migrated database.
type DB struct {
	e       *engine.DB
	dialect Dialect
	log     *slog.Logger
	// seq makes PostgreSQL events readable once committed (sequencer.go).
	seq *sequencer
	// dsn and channel (PostgreSQL): the listener's connection string and
	// the channel of command notifications (notify.go).
	dsn, channel string
	// streamKey seals event and audit cursors (streamkey.go).
	streamKey StreamKey
	// work tells this process's controller that work was queued or made
	// due (workqueue.go).
	work workSignal

	closeOnce sync.Once
}

// Open opens and migrates the database named by cfg.
func Open(ctx context.Context, cfg Config, log *slog.Logger) (*DB, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	e, err := engine.Open(ctx, engine.Config{
		Driver: cfg.Driver, Path: cfg.Path, DSN: cfg.DSN, MaxConns: cfg.MaxConns,
		OutageWait: cfg.OutageWait, Migrations: sub, BusyTimeout: cfg.busyTimeout,
		CheckpointPages: cfg.checkpointPages, CheckpointEvery: cfg.checkpointEvery,
	}, log)
	if err != nil {
		return nil, err
	}
	db := &DB{e: e, dialect: e.Dialect(), log: log, dsn: cfg.DSN}
	if db.dialect == Postgres {
		var schema string
		if err := e.Pool().QueryRowContext(ctx, "SELECT COALESCE(current_schema(), '')").Scan(&schema); err != nil {
			e.Close()
			return nil, fmt.Errorf("read the current schema: %w", err)
		}
		db.channel = commandsChannel(schema)
		db.seq = newSequencer(db)
		go db.seq.run()
	}
	if err := db.loadStreamKey(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

// Dialect tells which database this is.
func (db *DB) Dialect() Dialect { return db.dialect }

// Close closes the database. Write transactions already begun finish
// first; any begun afterwards fail (UNAVAILABLE: the database is
// unreachable). Read transactions must have ended.
func (db *DB) Close() error {
	db.closeOnce.Do(func() {
		if db.seq != nil {
			db.seq.stop()
		}
	})
	return db.e.Close()
}

// Ping checks that the database answers (readiness).
func (db *DB) Ping(ctx context.Context) error { return db.e.Ping(ctx) }

// CheckWrites reports whether the database takes writes now (readiness,
// R19.1): a database can answer reads while it refuses every write. The
// error is UNAVAILABLE naming the reason (UnavailableReason).
func (db *DB) CheckWrites(ctx context.Context) error { return db.e.CheckWrites(ctx) }

// Tx is a database transaction. Its typed methods (in the other files of this
// package) are the only SQL the control plane runs.
type Tx struct {
	e  *engine.Tx
	db *DB
	// visible runs once the events the transaction inserted are readable
	// (wake event followers): at once on SQLite, after the sequencer on
	// PostgreSQL; events is set when it inserted events.
	visible []func()
	events  bool
}

// The engine's statements, as the typed methods call them.
func (t *Tx) exec(ctx context.Context, q string, args ...any) (sql.Result, error) {
	return t.e.Exec(ctx, q, args...)
}

func (t *Tx) query(ctx context.Context, q string, args ...any) (Rows, error) {
	return t.e.Query(ctx, q, args...)
}

func (t *Tx) queryRow(ctx context.Context, q string, args ...any) *engine.Row {
	return t.e.QueryRow(ctx, q, args...)
}

// execLater runs q now on SQLite, and on PostgreSQL with the transaction's
// next statement or before its COMMIT (engine.Tx.ExecLater): only for
// statements whose result no caller needs and whose failure is the
// transaction's failure.
func (t *Tx) execLater(ctx context.Context, q string, args ...any) error {
	return t.e.ExecLater(ctx, q, args...)
}

// execLaterRows is execLater for a statement that must affect exactly rows
// rows, failing with "name: wrong" otherwise (engine.Tx.ExecLaterRows).
func (t *Tx) execLaterRows(ctx context.Context, name string, rows int64, wrong error, q string, args ...any) error {
	return t.e.ExecLaterRows(ctx, name, rows, wrong, q, args...)
}

// Rows is what Tx.query returns; its caller reads and closes it as it
// would a *sql.Rows.
type Rows = engine.Rows

// Dialect tells which database the transaction runs on.
func (t *Tx) Dialect() Dialect { return t.e.Dialect() }

// AfterCommit registers fn to run after a successful commit.
func (t *Tx) AfterCommit(fn func()) { t.e.AfterCommit(fn) }

// AfterEventsVisible registers fn to run once the transaction committed and
// the events it inserted can be read (ListEvents). On SQLite that is the
// commit; on PostgreSQL it is the sequencer's next pass (sequencer.go).
func (t *Tx) AfterEventsVisible(fn func()) { t.visible = append(t.visible, fn) }

// wrap makes fn a function of the engine's transactions. Once fn succeeded
// it registers the events-visible hooks last, so they run after every
// after-commit hook.
func (db *DB) wrap(fn func(*Tx) error) func(*engine.Tx) error {
	return func(et *engine.Tx) error {
		t := &Tx{e: et, db: db}
		if err := fn(t); err != nil {
			return err
		}
		if len(t.visible) > 0 || t.events {
			et.AfterCommit(t.eventsVisible)
		}
		return nil
	}
}

// eventsVisible hands the transaction's events-visible hooks to the
// sequencer when it inserted events on PostgreSQL, and runs them now
// otherwise.
func (t *Tx) eventsVisible() {
	if t.db.seq != nil && t.events {
		t.db.seq.committed(t.visible)
		return
	}
	for _, f := range t.visible {
		t.db.e.Safely("events-visible hook", f)
	}
}

// Now reads compute_now(), the database's clock.
func (t *Tx) Now(ctx context.Context) (time.Time, error) {
	var ms int64
	if err := t.queryRow(ctx, "SELECT compute_now()").Scan(&ms); err != nil {
		return time.Time{}, fmt.Errorf("read compute_now: %w", err)
	}
	return time.UnixMilli(ms).UTC(), nil
}

// ErrCommitUnknown wraps the error of a commit whose outcome cannot be
// known: COMMIT was sent and no answer came. The transaction may have
// landed or not; the caller must not treat it as a rollback. Domain code
// retries such a change only where retrying is idempotent (a join request
// arriving again gets its stored answer, R4.9). It carries UNAVAILABLE so
// that the wire tells the caller to retry.
var ErrCommitUnknown = engine.ErrCommitUnknown

// WithTx runs fn in a write transaction and commits it when fn returns nil.
// Any error rolls everything back, so nothing is half-written. Serialization
// failures and deadlocks (PostgreSQL) are retried with fn run anew, so fn must
// not have effects outside the transaction.
//
// A failure of the database itself (unreachable, read-only, out of
// space: UnavailableReason) comes back as UNAVAILABLE with the driver's
// error as its cause (R19.1), so callers and the wire see a retryable
// error, never INTERNAL.
//
// The outcome WithTx reports is the truth: nil means the transaction
// committed, even when ctx ended meanwhile; an error means it did not,
// except an error wrapping ErrCommitUnknown. ctx interrupts fn's statements
// (fn then fails and everything rolls back); once fn has returned nil the
// commit no longer depends on ctx.
//
// A database that is down, read-only or full is waited for up to
// OutageWait, fn run anew each time: a short outage costs a join or
// renewal latency, not a failure.
func (db *DB) WithTx(ctx context.Context, fn func(*Tx) error) error {
	return db.e.WithTx(ctx, db.wrap(fn))
}

// ReadLatest runs fn, which only reads, so that it sees whatever a
// transaction that made a concurrent one fail had written (on SQLite it
// runs through the writer; engine.DB.ReadLatest). Like ReadTx it does not
// wait out an outage.
func (db *DB) ReadLatest(ctx context.Context, fn func(*Tx) error) error {
	return db.e.ReadLatest(ctx, db.wrap(fn))
}

// ReadTx runs fn in a read-only transaction that is always rolled back.
func (db *DB) ReadTx(ctx context.Context, fn func(*Tx) error) error {
	return db.e.ReadTx(ctx, db.wrap(fn))
}

// errUniqueViolation is a unique violation a statement detected itself
// (an upsert that left a live row alone), not one the database raised.
var errUniqueViolation = engine.ErrUniqueViolation

// IsUniqueViolation reports whether err is a unique-constraint violation.
func IsUniqueViolation(err error) bool { return engine.IsUniqueViolation(err) }

// Why a store cannot take a statement now, as UnavailableReason names it.
const (
	UnavailableUnreachable = engine.UnavailableUnreachable
	UnavailableReadOnly    = engine.UnavailableReadOnly
	UnavailableFull        = engine.UnavailableFull
)

// UnavailableReason says why err means the database cannot take work
// right now (it is unreachable or restarting, read-only, or out of space),
// "" when it does not. Such a failure is the caller's to retry, never an
// internal error (R19.1).
func UnavailableReason(err error) string { return engine.UnavailableReason(err) }

// SetClockOffset moves compute_now() by d from wall time. Tests use it to
// expire tokens without waiting; an operator never needs it.
func (db *DB) SetClockOffset(ctx context.Context, d time.Duration) error {
	return db.WithTx(ctx, func(t *Tx) error {
		_, err := t.exec(ctx, "UPDATE compute_clock SET offset_ms = ? WHERE id = 1", d.Milliseconds())
		return err
	})
}
