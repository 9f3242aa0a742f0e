package engine

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// A PostgreSQL transaction, read or write, is BEGIN, fn's statements and
// COMMIT (ROLLBACK for a read) on one connection of the pool, all sent on
// its pgx connection by this file and pipeline.go rather than through
// database/sql, so that BEGIN costs no round trip of its own: it is held
// back and sent in one batch with the transaction's first statement
// (pipeline.go). A join is then 6 round trips: BEGIN with the token read,
// the pool, the hardware key, the node, one batch of the held-back
// inserts, the stored answer and the spend, and COMMIT; a read
// transaction of one query is 2 (BEGIN READ ONLY with the query, and
// ROLLBACK).
//
// The outcome is reported as WithTx promises: the caller's context bounds
// the wait for a connection and every statement (BEGIN included), never
// the COMMIT, which runs on a context of the transaction's own bounded by
// db.commitTimeout; a COMMIT that got no answer is ErrCommitUnknown.

// pgTx runs fn in a PostgreSQL transaction: a write transaction commits
// when fn returns nil, a read-only one always rolls back.
func (db *DB) pgTx(ctx context.Context, readOnly bool, fn func(*Tx) error) error {
	txCtx, cancelTx := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelTx()
	stop := context.AfterFunc(ctx, cancelTx)
	conn, err := db.w.Conn(txCtx)
	if !stop() && err == nil {
		// The caller left while a connection was being taken.
		conn.Close()
		return fmt.Errorf("begin transaction: %w", ctx.Err())
	}
	if err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	defer conn.Close()
	t := &Tx{db: db, conn: conn, begin: true, readOnly: readOnly}
	if err := conn.Raw(func(dc any) error {
		// The pgx connection is used past Raw: conn holds it for this
		// transaction alone, and every call on it is made here, one at a
		// time.
		t.pg = dc.(*stdlib.Conn).Conn()
		return nil
	}); err != nil {
		return fmt.Errorf("begin transaction: %w", err)
	}
	// Roll back whatever way fn leaves (an error, a panic, a test's
	// t.Fatal): a transaction left open would hold locks.
	finished := false
	defer func() {
		if !finished {
			t.rollback(txCtx)
		}
	}()
	if err := fn(t); err != nil {
		if t.err != nil {
			// A held-back statement failed: that is the cause.
			return t.err
		}
		return err
	}
	if readOnly {
		return nil // rolled back
	}
	if len(t.later) > 0 {
		if err := t.flush(ctx); err != nil {
			return err
		}
	}
	t.settle()
	finished = true
	if err := db.commit(t, txCtx, cancelTx); err != nil {
		return err
	}
	t.committed()
	return nil
}

// commit commits t on txCtx, which cancel ends, bounded by
// db.commitTimeout, and tells a rollback from an unknown outcome. A
// transaction whose BEGIN never left ran nothing: there is nothing to
// commit.
func (db *DB) commit(t *Tx, txCtx context.Context, cancel context.CancelFunc) error {
	if t.begin {
		return nil
	}
	bound := time.AfterFunc(db.commitTimeout, cancel)
	tag, err := t.pg.Exec(txCtx, "COMMIT")
	bound.Stop()
	if err == nil && tag.String() != "COMMIT" {
		// The server answered COMMIT with ROLLBACK: the transaction had
		// failed (as pgx's own Tx.Commit reports it).
		err = pgx.ErrTxCommitRollback
	}
	if err == nil {
		return nil
	}
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe), errors.Is(err, pgx.ErrTxCommitRollback):
		// The server answered: it rolled back (a deferred constraint, a
		// serialization failure at commit, a transaction already failed).
		return fmt.Errorf("commit: %w", err)
	case pgconn.SafeToRetry(err):
		// COMMIT never left: the connection was already gone, and the
		// server rolls back a transaction whose connection closed.
		return fmt.Errorf("commit: %w", err)
	default:
		return fmt.Errorf("commit: %w: %w", ErrCommitUnknown, err)
	}
}

// rollback ends a transaction that will not commit. One that cannot be
// rolled back has its connection discarded (the server rolls back a
// transaction whose connection closed), so it never returns to the pool
// inside a transaction.
func (t *Tx) rollback(ctx context.Context) {
	t.settle()
	if t.begin {
		return
	}
	if _, err := t.pg.Exec(ctx, "ROLLBACK"); err != nil {
		_ = t.conn.Raw(func(any) error { return driver.ErrBadConn })
	}
}

// pgExec runs q on the transaction's connection, with what is held back in
// one batch when anything is.
func (t *Tx) pgExec(ctx context.Context, q string, args ...any) (sql.Result, error) {
	t.settle()
	if t.err != nil {
		return nil, t.err
	}
	if t.begin || len(t.later) > 0 {
		if len(args) > 0 || !strings.Contains(q, ";") {
			return t.pipeline(ctx, q, args...)
		}
		// Several statements in one text run only as a simple query,
		// never in a batch: send what is held back first.
		if err := t.flush(ctx); err != nil {
			return nil, err
		}
	}
	tag, err := t.pg.Exec(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	return tagResult(tag), nil
}

// pgQuery sends what is held back, then runs q.
func (t *Tx) pgQuery(ctx context.Context, q string, args ...any) (Rows, error) {
	if err := t.flush(ctx); err != nil {
		return nil, err
	}
	rows, err := t.pg.Query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	return &pgRows{rows: rows}, nil
}

// pgQueryRow runs the one-row query q, in one batch with what is held
// back when anything is; its row is read when scanned.
func (t *Tx) pgQueryRow(ctx context.Context, q string, args ...any) *Row {
	t.settle()
	if t.err != nil {
		return &Row{err: t.err}
	}
	if t.begin || len(t.later) > 0 {
		return t.pipelineRow(ctx, q, args...)
	}
	rows, err := t.pg.Query(ctx, q, args...)
	if err != nil {
		return &Row{err: err}
	}
	r := &Row{pg: rows}
	t.open = r
	return r
}

// pgRows are a PostgreSQL query's rows as Rows.
type pgRows struct{ rows pgx.Rows }

func (r *pgRows) Next() bool             { return r.rows.Next() }
func (r *pgRows) Scan(dest ...any) error { return r.rows.Scan(dest...) }
func (r *pgRows) Err() error             { return r.rows.Err() }

// Close releases the connection for the transaction's next statement; as
// with database/sql, a failure of the query is Err's.
func (r *pgRows) Close() error {
	r.rows.Close()
	return nil
}

// Columns names the rows' columns.
func (r *pgRows) Columns() ([]string, error) {
	fds := r.rows.FieldDescriptions()
	names := make([]string, len(fds))
	for i, fd := range fds {
		names[i] = fd.Name
	}
	return names, nil
}
