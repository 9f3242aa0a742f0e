// Package engine runs the store's SQL: it opens SQLite (the embedded
// default) or PostgreSQL, migrates it, and runs transactions on it. It knows
// no table: package store, its only importer, holds every query and gives
// the engine its migrations.
//
// The narrow API: Open (Config, with the migrations), DB.WithTx (writes),
// DB.ReadTx and DB.ReadLatest (reads), and inside a transaction Tx.Exec,
// Tx.Query, Tx.QueryRow and the held-back Tx.ExecLater/ExecLaterRows, plus
// AfterCommit; errors are classified by UnavailableReason,
// IsUniqueViolation and ErrCommitUnknown.
//
// The SQL is written once, with ? placeholders and compute_now(), and
// rewritten per dialect: $n placeholders for PostgreSQL, an inline expression
// for compute_now() on SQLite; string literals, quoted identifiers and
// comments are left as written (rewrite.go).
//
// A write transaction's outcome is reported truthfully (WithTx): a caller's
// context interrupts its statements but never its COMMIT, so a commit that
// landed is never reported as failed; a PostgreSQL COMMIT that got no answer
// is ErrCommitUnknown, never a rollback.
//
// One execution path per dialect and kind of transaction:
//   - SQLite writes: one writer goroutine holds the one writer connection
//     and runs concurrent transactions as savepoints of one shared
//     transaction ("group commit", groupcommit.go), each statement straight
//     on modernc's driver connection (writerconn.go, row.go); WAL
//     checkpoints run mostly off the writer (checkpoint.go).
//   - PostgreSQL writes: BEGIN, the statements and COMMIT on one pgx
//     connection (pgtx.go), statements whose result nothing reads held
//     back and sent with the next one as one batch (pipeline.go).
//   - PostgreSQL reads: the same, BEGIN READ ONLY and ROLLBACK.
//   - SQLite reads: a database/sql read transaction of the readers' pool,
//     its statements prepared once per pool.
//
// A database that is down, read-only or full is waited for and then answers
// UNAVAILABLE (outage.go, unavailable.go).
package engine

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" driver
	"github.com/pressly/goose/v3"
	_ "modernc.org/sqlite" // registers the "sqlite" driver

	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// Dialect names a supported database.
type Dialect string

// The supported databases.
const (
	SQLite   Dialect = "sqlite"
	Postgres Dialect = "postgres"
)

// Config says which database to open.
type Config struct {
	// Driver is "sqlite" (default) or "postgres".
	Driver string
	// Path is the SQLite database file (sqlite only).
	Path string
	// DSN is the PostgreSQL connection string (postgres only).
	DSN string
	// MaxConns bounds PostgreSQL connections (default 16).
	MaxConns int
	// OutageWait is how long a write transaction waits for a database that
	// is down, read-only or full to take writes again before it answers
	// UNAVAILABLE: 0 is DefaultOutageWait, a negative one answers at once
	// (R19.1, outage.go).
	OutageWait time.Duration
	// Migrations holds one directory of goose migrations per dialect
	// ("sqlite", "postgres"), applied by Open.
	Migrations fs.FS

	// BusyTimeout is how long SQLite waits for a lock another process
	// holds (default 10 s).
	BusyTimeout time.Duration
	// CheckpointPages and CheckpointEvery override when the checkpointer
	// runs when positive (checkpoint.go).
	CheckpointPages int64
	CheckpointEvery time.Duration
}

// DB is an open, migrated database.
type DB struct {
	dialect Dialect
	w       *sql.DB // the writer: one connection on SQLite
	// wdsn is the SQLite writer's DSN: the writer goroutine holds w's one
	// connection, so a migration run after Open (tests) opens its own.
	wdsn string
	r    *sql.DB // readers
	log  *slog.Logger

	// writes feeds SQLite's writer goroutine (group commit, groupcommit.go);
	// writerDone is closed when that goroutine has returned its connection.
	// wc is the connection it holds (writerconn.go): the writer's only.
	writes     chan *writeReq
	writerDone chan struct{}
	wc         *writerConn
	closeOnce  sync.Once
	// closeMu guards closed and the sends on writes: Close closes writes
	// under it, so a submit after Close is told ErrClosed.
	closeMu sync.RWMutex
	closed  bool
	// migrationFS holds the migrations of every dialect (Config.Migrations).
	migrationFS fs.FS
	// commitTimeout bounds a COMMIT on PostgreSQL, which runs detached from
	// the caller's context (see commit).
	commitTimeout time.Duration
	// ckpt copies SQLite's WAL into the database file (checkpoint.go).
	ckpt *checkpointer
	// outageWait bounds a write's wait for the database (outage.go); probe
	// caches the readiness write probe.
	outageWait time.Duration
	probe      writeProbe

	stmt sync.Map // query text -> rewritten text

	// SQLite only: the prepared statements of the readers, by rewritten
	// text. Parsing the SQL was a sixth of a join's CPU; a statement
	// prepared once per pool is reused on each of its connections
	// (Tx.StmtContext). The writer keeps its own on its connection
	// (writerConn). PostgreSQL needs none: pgx caches prepared statements
	// per connection (its default query exec mode, cache_statement).
	rStmts *stmtCache
}

// stmtCache holds one pool's prepared statements.
type stmtCache struct {
	pool *sql.DB
	m    sync.Map // rewritten text -> *sql.Stmt
}

// prepare prepares q on the pool unless it was already. It must not run
// inside a transaction of the pool: preparing takes a connection of its own,
// and the writer pool has only the one the transaction holds.
func (c *stmtCache) prepare(ctx context.Context, q string) error {
	if _, ok := c.m.Load(q); ok {
		return nil
	}
	st, err := c.pool.PrepareContext(ctx, q)
	if err != nil {
		return fmt.Errorf("prepare statement: %w", err)
	}
	if _, dup := c.m.LoadOrStore(q, st); dup {
		st.Close()
	}
	return nil
}

func (c *stmtCache) get(q string) *sql.Stmt {
	if c == nil {
		return nil
	}
	if v, ok := c.m.Load(q); ok {
		return v.(*sql.Stmt)
	}
	return nil
}

func (c *stmtCache) close() error {
	if c == nil {
		return nil
	}
	var err error
	c.m.Range(func(k, v any) bool {
		err = errors.Join(err, v.(*sql.Stmt).Close())
		c.m.Delete(k)
		return true
	})
	return err
}

// Open opens and migrates the database named by cfg.
func Open(ctx context.Context, cfg Config, log *slog.Logger) (*DB, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	switch cfg.Driver {
	case "", string(SQLite):
		return openSQLite(ctx, cfg, log)
	case string(Postgres), "postgresql", "pgx":
		return openPostgres(ctx, cfg, log)
	default:
		return nil, errs.New(errs.InvalidConfig, "store.driver %q: want sqlite or postgres", cfg.Driver)
	}
}

func openSQLite(ctx context.Context, cfg Config, log *slog.Logger) (*DB, error) {
	if cfg.Path == "" {
		return nil, errs.New(errs.InvalidConfig, "store.path: the SQLite database file is required")
	}
	if dir := filepath.Dir(cfg.Path); dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("create database directory: %w", err)
		}
	}
	if err := ownerOnly(cfg.Path); err != nil {
		return nil, err
	}
	busy := cfg.BusyTimeout
	if busy <= 0 {
		busy = 10 * time.Second
	}
	// temp_store(MEMORY) keeps the statement and savepoint journals in
	// memory: every group-commit participant runs in a SAVEPOINT, which
	// copies each page it changes into a sub-journal first, and with the
	// default the sub-journal spills to a temporary file past 64 KiB (a
	// batch of joins does), one pwrite per page and a file created and
	// unlinked per batch: a fifth of a join's SQLite CPU. A batch's
	// sub-journal is bounded (maxBatch participants, tens of pages each).
	base := "file:" + filepath.ToSlash(cfg.Path) + "?" + url.Values{
		"_pragma": {"journal_mode(WAL)", fmt.Sprintf("busy_timeout(%d)", busy.Milliseconds()), "foreign_keys(ON)", "synchronous(NORMAL)", "temp_store(MEMORY)"},
	}.Encode()
	// One writer connection: a pool of SQLite writers only contends for the
	// file lock (seen stalling for seconds under load).
	// No automatic checkpoint in the writer's commits: checkpoint.go decides
	// when, and mostly off the writer.
	w, err := sql.Open("sqlite", base+"&_txlock=immediate&"+url.Values{"_pragma": {"wal_autocheckpoint(0)"}}.Encode())
	if err != nil {
		return nil, fmt.Errorf("open sqlite: %w", err)
	}
	w.SetMaxOpenConns(1)
	w.SetConnMaxIdleTime(0)
	r, err := sql.Open("sqlite", base+"&"+url.Values{"_pragma": {"query_only(ON)"}}.Encode())
	if err != nil {
		w.Close()
		return nil, fmt.Errorf("open sqlite: %w", err)
	}
	r.SetMaxOpenConns(8)
	// Keep every reader open: a closed connection takes its prepared
	// statements with it.
	r.SetMaxIdleConns(8)
	db := &DB{dialect: SQLite, w: w, wdsn: base + "&_txlock=immediate", r: r, log: log, rStmts: &stmtCache{pool: r},
		writes: make(chan *writeReq, maxBatch), writerDone: make(chan struct{}), commitTimeout: defaultCommitTimeout,
		outageWait: cfg.outageWait(), migrationFS: cfg.Migrations}
	if err := db.migrate(ctx); err != nil {
		close(db.writerDone)
		db.Close()
		return nil, err
	}
	cp, err := sql.Open("sqlite", base)
	if err != nil {
		close(db.writerDone)
		db.Close()
		return nil, fmt.Errorf("open sqlite: %w", err)
	}
	cp.SetMaxOpenConns(1)
	db.ckpt = newCheckpointer(db, cp, cfg.CheckpointPages, cfg.CheckpointEvery)
	go db.ckpt.run()
	go db.writer()
	return db, nil
}

// ownerOnly makes the SQLite database file, and its -wal and -shm files when
// they exist, readable by their owner only (0600). SECURITY: the database
// holds API key and token hashes, the audit trail and every node's
// identity; a file the driver creates takes the umask (0644 by default).
// The file is created before the driver opens it, and SQLite gives the WAL
// and SHM files it creates the database file's mode; files an older
// version left 0644 are tightened at every open.
func ownerOnly(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("create database file: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("create database file: %w", err)
	}
	for _, p := range []string{path, path + "-wal", path + "-shm"} {
		if err := os.Chmod(p, 0o600); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("make the database file owner-only: %w", err)
		}
	}
	return nil
}

func openPostgres(ctx context.Context, cfg Config, log *slog.Logger) (*DB, error) {
	if cfg.DSN == "" {
		return nil, errs.New(errs.InvalidConfig, "store.dsn: the PostgreSQL connection string is required")
	}
	p, err := sql.Open("pgx", cfg.DSN)
	if err != nil {
		return nil, fmt.Errorf("open postgres: %w", err)
	}
	n := cfg.MaxConns
	if n <= 0 {
		n = 16
	}
	p.SetMaxOpenConns(n)
	p.SetMaxIdleConns(n)
	p.SetConnMaxIdleTime(5 * time.Minute)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := p.PingContext(pctx); err != nil {
		p.Close()
		return nil, errs.New(errs.Unavailable, "cannot reach PostgreSQL: %v", err)
	}
	db := &DB{dialect: Postgres, w: p, r: p, log: log, commitTimeout: defaultCommitTimeout, outageWait: cfg.outageWait(), migrationFS: cfg.Migrations}
	if err := db.migrate(ctx); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

func (db *DB) migrate(ctx context.Context) error {
	p, err := db.migrations(db.w)
	if err != nil {
		return err
	}
	res, err := p.Up(ctx)
	if err != nil {
		return fmt.Errorf("migrate %s: %w", db.dialect, err)
	}
	for _, r := range res {
		db.log.Info("applied migration", "dialect", db.dialect, "version", r.Source.Version)
	}
	return nil
}

// migrations is the goose provider of db's dialect, migrating through pool.
func (db *DB) migrations(pool *sql.DB) (*goose.Provider, error) {
	if db.migrationFS == nil {
		return nil, errors.New("migrations: none given")
	}
	sub, err := fs.Sub(db.migrationFS, string(db.dialect))
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	gd := goose.DialectSQLite3
	if db.dialect == Postgres {
		gd = goose.DialectPostgres
	}
	p, err := goose.NewProvider(gd, pool, sub)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// Dialect tells which database this is.
func (db *DB) Dialect() Dialect { return db.dialect }

// ErrClosed is what a transaction begun after Close gets. Like any
// failure of a database that is gone, UnavailableReason names it
// unreachable: the process is stopping, and another replica, or this one
// restarted, takes the retry.
var ErrClosed = errors.New("sql: database is closed")

// Close closes the database: write transactions already handed to the
// SQLite writer finish first, and any begun afterwards fail with ErrClosed.
// Read transactions must have ended.
func (db *DB) Close() error {
	db.closeOnce.Do(func() {
		if db.writes != nil {
			db.closeMu.Lock()
			db.closed = true
			close(db.writes)
			db.closeMu.Unlock()
			<-db.writerDone
		}
		if db.ckpt != nil {
			db.ckpt.stop()
		}
	})
	err := db.rStmts.close()
	err = errors.Join(err, db.w.Close())
	if db.r != db.w {
		err = errors.Join(err, db.r.Close())
	}
	return err
}

// Ping checks that the database answers (readiness).
func (db *DB) Ping(ctx context.Context) error {
	var one int
	return db.r.QueryRowContext(ctx, "SELECT 1").Scan(&one)
}

// Tx is a database transaction: what WithTx, ReadTx and ReadLatest hand
// their function. It is not safe for concurrent use.
type Tx struct {
	db *DB
	// Exactly one of these runs the statements (one path per dialect and
	// kind): wc, SQLite's writer connection holding the shared transaction
	// (groupcommit.go); pg, a PostgreSQL transaction's pgx connection
	// (pgtx.go); tx, a SQLite read transaction.
	wc *writerConn
	pg *pgx.Conn
	tx *sql.Tx
	// after runs once the transaction committed (e.g. wake a controller).
	after []func()
	// shared marks a participant of SQLite's shared (group-committed)
	// transaction: its statements must never be interrupted by its own
	// context, because SQLite answers an interrupted write by rolling back
	// the whole transaction, every other participant's work included.
	shared bool
	// stmts is the readers' statement cache (SQLite), unprepared the queries
	// this transaction ran that it lacked: they are prepared once the
	// transaction ended and its connection is free.
	stmts      *stmtCache
	unprepared []string
	// conn is a PostgreSQL transaction's pooled connection, the one pg
	// belongs to. pg sends the held-back statements (later) as one batch
	// with the next one (pipeline.go), BEGIN (BEGIN READ ONLY when
	// readOnly) first while begin says it has not been sent; err is the
	// failure of a held-back statement.
	conn     *sql.Conn
	begin    bool
	readOnly bool
	later    []queued
	err      error
	// open is a PostgreSQL row not yet scanned (QueryRow); the next
	// statement closes it (settle).
	open *Row
}

// settle closes a PostgreSQL row the caller did not scan, so that the
// connection can take the next statement.
func (t *Tx) settle() {
	if t.open != nil {
		_ = t.open.close()
		t.open = nil
	}
}

// stmtCtx is the context a statement runs with. In SQLite's shared
// transaction a statement that has started runs to its end: a context
// already done fails the statement before it reaches the driver (err),
// and one that ends while the statement runs is noticed by the next
// statement. The driver never sees a context that can end, so it never
// interrupts a statement (SQLite would roll back the whole transaction)
// and database/sql starts no goroutine to watch one. Elsewhere the
// caller's context interrupts the statement (PostgreSQL then rolls back
// only this transaction).
func (t *Tx) stmtCtx(ctx context.Context) (context.Context, error) {
	if !t.shared {
		return ctx, nil
	}
	if err := ctx.Err(); err != nil {
		return ctx, err
	}
	return context.WithoutCancel(ctx), nil
}

// stmt returns the prepared form of the rewritten query q in this
// transaction, or nil to run q as text.
func (t *Tx) stmt(ctx context.Context, q string) *sql.Stmt {
	if t.stmts == nil {
		return nil
	}
	if st := t.stmts.get(q); st != nil {
		return t.tx.StmtContext(ctx, st)
	}
	t.unprepared = append(t.unprepared, q)
	return nil
}

// Exec runs q, which returns no rows.
func (t *Tx) Exec(ctx context.Context, q string, args ...any) (sql.Result, error) {
	ctx, err := t.stmtCtx(ctx)
	if err != nil {
		return nil, err
	}
	q = t.db.rewrite(q)
	switch {
	case t.wc != nil:
		return t.wc.exec(q, args...)
	case t.pg != nil:
		return t.pgExec(ctx, q, args...)
	}
	if st := t.stmt(ctx, q); st != nil {
		return st.ExecContext(ctx, args...)
	}
	return t.tx.ExecContext(ctx, q, args...)
}

// Query runs q and returns its rows, which the caller reads and closes
// before the transaction's next statement.
func (t *Tx) Query(ctx context.Context, q string, args ...any) (Rows, error) {
	ctx, err := t.stmtCtx(ctx)
	if err != nil {
		return nil, err
	}
	q = t.db.rewrite(q)
	switch {
	case t.wc != nil:
		return t.wc.query(q, args...)
	case t.pg != nil:
		return t.pgQuery(ctx, q, args...)
	}
	if st := t.stmt(ctx, q); st != nil {
		return st.QueryContext(ctx, args...)
	}
	return t.tx.QueryContext(ctx, q, args...)
}

// QueryRow runs q and returns its first row, to be scanned once (as a
// *sql.Row is) before the transaction's next statement.
func (t *Tx) QueryRow(ctx context.Context, q string, args ...any) *Row {
	ctx, err := t.stmtCtx(ctx)
	if err != nil {
		return &Row{err: err}
	}
	q = t.db.rewrite(q)
	switch {
	case t.wc != nil:
		return t.wc.queryRow(q, args...)
	case t.pg != nil:
		return t.pgQueryRow(ctx, q, args...)
	}
	if st := t.stmt(ctx, q); st != nil {
		return &Row{sr: st.QueryRowContext(ctx, args...)}
	}
	return &Row{sr: t.tx.QueryRowContext(ctx, q, args...)}
}

// Dialect tells which database the transaction runs on.
func (t *Tx) Dialect() Dialect { return t.db.dialect }

// AfterCommit registers fn to run after a successful commit, in the order
// registered, before the caller of WithTx is answered. A read
// transaction's never run.
func (t *Tx) AfterCommit(fn func()) { t.after = append(t.after, fn) }

// committed runs the transaction's hooks after its commit. A panicking hook
// is logged: the transaction committed whatever its hooks do, and on SQLite
// the hooks run on the writer, which must go on.
func (t *Tx) committed() {
	for _, f := range t.after {
		t.db.Safely("after-commit hook", f)
	}
}

// Safely runs f, logging (as what) a panic instead of passing it on.
func (db *DB) Safely(what string, f func()) {
	defer func() {
		if p := recover(); p != nil {
			db.log.Error("panic in "+what, "panic", p, "stack", string(debug.Stack()))
		}
	}()
	f()
}

const maxAttempts = 5

// defaultCommitTimeout bounds a PostgreSQL COMMIT. It is long: a COMMIT
// that is given up on has an unknown outcome (ErrCommitUnknown), which is
// worse for the caller than a slow answer.
const defaultCommitTimeout = 15 * time.Second

// ErrCommitUnknown wraps the error of a commit whose outcome cannot be
// known: COMMIT was sent and no answer came (the connection broke, or the
// database did not answer within the commit bound). The transaction may
// have landed or not; the caller must not treat it as a rollback. Domain
// code retries such a change only where retrying is idempotent (a join
// request arriving again gets its stored answer, R4.9). It carries
// UNAVAILABLE so that the wire tells the caller to retry.
var ErrCommitUnknown = errs.New(errs.Unavailable, "the outcome of the change is unknown; retry it")

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
// OutageWait, fn run anew each time (outage.go): a short outage costs a
// join or renewal latency, not a failure.
func (db *DB) WithTx(ctx context.Context, fn func(*Tx) error) (err error) {
	ctx, span := tracing.Start(ctx, tracing.SpanStoreTx)
	defer func() { tracing.End(span, err) }()
	return db.withOutageWait(ctx, db.outageWait, func() error { return db.withTx(ctx, fn) })
}

// withTx is WithTx without the outage wait.
func (db *DB) withTx(ctx context.Context, fn func(*Tx) error) error {
	var err error
	for attempt := 1; attempt <= maxAttempts; attempt++ {
		err = db.write(ctx, fn)
		if !retryable(err) || ctx.Err() != nil {
			return Unavailable(err)
		}
		db.log.Debug("retrying transaction", "attempt", attempt, "err", err)
		if txRetry.Wait(ctx, clock.Real{}, attempt) != nil {
			return Unavailable(err)
		}
	}
	return Unavailable(err)
}

// txRetry spaces the retries of a transaction that failed to serialize:
// 5 ms doubling, so the last of maxAttempts waits well under a second.
var txRetry = backoff.Policy{Min: 5 * time.Millisecond, Max: 320 * time.Millisecond}

// ReadLatest runs fn, which only reads, so that it sees whatever a
// transaction that made a concurrent one fail had written. On SQLite it
// runs through the writer, not a read transaction: a participant of a
// group commit that fails is told at once, before the batch committed,
// and a read transaction would not see its peers' rows yet; the writer
// runs fn in the batch still open or after it, and reports only once what
// fn read committed. On PostgreSQL a transaction fails because of another
// only once that one committed (it saw its rows or waited on its locks),
// so a read transaction sees them.
//
// Like ReadTx it does not wait out an outage (outage.go): a join that
// failed on one reads its stored answer once, and answers at once.
func (db *DB) ReadLatest(ctx context.Context, fn func(*Tx) error) error {
	if db.dialect == SQLite {
		return db.withTx(ctx, fn)
	}
	return db.ReadTx(ctx, fn)
}

// ReadTx runs fn in a read-only transaction that is always rolled back.
func (db *DB) ReadTx(ctx context.Context, fn func(*Tx) error) error {
	if db.dialect == Postgres {
		return Unavailable(db.pgTx(ctx, true, fn))
	}
	return Unavailable(db.sqliteRead(ctx, fn))
}

// write runs fn in a write transaction: SQLite's writer, or PostgreSQL's.
func (db *DB) write(ctx context.Context, fn func(*Tx) error) error {
	if db.dialect == SQLite {
		return db.submit(ctx, fn)
	}
	return db.pgTx(ctx, false, fn)
}

// sqliteRead runs fn in a SQLite read transaction of the readers' pool.
func (db *DB) sqliteRead(ctx context.Context, fn func(*Tx) error) error {
	stx, err := db.r.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	t := &Tx{db: db, tx: stx, stmts: db.rStmts}
	// A read transaction always rolls back, whatever way fn leaves (an
	// error, a panic, a test's t.Fatal). Its queries are prepared after
	// the rollback: a prepare takes a connection of the read pool, and
	// this transaction's must be back in it first, or as many first reads
	// as the pool has connections (a restart under thousands of sessions)
	// hold them all, each waiting for another.
	defer func() {
		_ = stx.Rollback()
		t.prepareUnprepared(ctx)
	}()
	return fn(t)
}

// prepareUnprepared prepares, for the next transactions, the queries this
// one ran as text. It runs after the transaction ended. A failure only
// means the query runs as text again next time.
func (t *Tx) prepareUnprepared(ctx context.Context) {
	for _, q := range t.unprepared {
		if err := t.stmts.prepare(context.WithoutCancel(ctx), q); err != nil {
			t.db.log.Debug("prepare statement", "err", err)
			return
		}
	}
}

func retryable(err error) bool {
	if errors.Is(err, ErrCommitUnknown) {
		// It may have landed: running fn again could apply it twice.
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == "40001" || pe.Code == "40P01"
	}
	return false
}

// ErrUniqueViolation is a unique violation a statement detected itself
// (an upsert that left a live row alone), not one the database raised.
var ErrUniqueViolation = errors.New("unique violation")

// IsUniqueViolation reports whether err is a unique-constraint violation.
func IsUniqueViolation(err error) bool {
	if errors.Is(err, ErrUniqueViolation) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == "23505"
	}
	return err != nil && strings.Contains(err.Error(), "UNIQUE constraint failed")
}

// Pool is the pool for statements outside any transaction: PostgreSQL's
// pool, SQLite's readers (query-only).
func (db *DB) Pool() *sql.DB { return db.r }

// QueuedWrites is how many write transactions wait for SQLite's writer.
func (db *DB) QueuedWrites() int { return len(db.writes) }

// WALPagesWritten is how many WAL pages SQLite's writer has appended (0 on
// PostgreSQL).
func (db *DB) WALPagesWritten() int64 {
	if db.ckpt == nil {
		return 0
	}
	return db.ckpt.written.Load()
}

// SetCommitTimeout sets the bound of a PostgreSQL COMMIT (by default 15 s);
// set it before any transaction runs.
func (db *DB) SetCommitTimeout(d time.Duration) { db.commitTimeout = d }

// MigrateDownTo rolls the schema back to version, and MigrateUp brings it
// up again (migration tests). On SQLite they migrate through a connection
// of their own: the writer goroutine holds the writer pool's only one.
func (db *DB) MigrateDownTo(ctx context.Context, version int64) error {
	return db.withMigrations(func(p *goose.Provider) error { _, err := p.DownTo(ctx, version); return err })
}

// MigrateUp applies every migration not applied yet.
func (db *DB) MigrateUp(ctx context.Context) error {
	return db.withMigrations(func(p *goose.Provider) error { _, err := p.Up(ctx); return err })
}

func (db *DB) withMigrations(fn func(*goose.Provider) error) error {
	pool := db.w
	if db.dialect == SQLite {
		own, err := sql.Open("sqlite", db.wdsn)
		if err != nil {
			return err
		}
		defer own.Close()
		pool = own
	}
	p, err := db.migrations(pool)
	if err != nil {
		return err
	}
	return fn(p)
}
