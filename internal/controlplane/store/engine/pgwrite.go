package engine

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// A PostgreSQL write transaction is BEGIN, fn's statements and COMMIT on
// one connection of the pool, sent by this file and pipeline.go rather
// than through a *sql.Tx, so that BEGIN costs no round trip of its own: it
// is held back and sent in one batch with the transaction's first
// statement (pipeline.go). A join is then 6 round trips: BEGIN with the
// token read, the pool, the hardware key, the node, one batch of the
// held-back inserts, the stored answer and the spend, and COMMIT.
//
// The outcome is reported as WithTx promises: the caller's context bounds
// the wait for a connection and every statement (BEGIN included), never
// the COMMIT, which runs on a context of the transaction's own bounded by
// db.commitTimeout; a COMMIT that got no answer is ErrCommitUnknown.

// pgWrite runs fn in a PostgreSQL write transaction and commits it.
func (db *DB) pgWrite(ctx context.Context, fn func(*Tx) error) error {
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
	t := &Tx{db: db, q: conn, conn: conn, begin: true}
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
