package store

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
)

// writerConn is SQLite's writer connection as the writer goroutine holds
// it: taken from the one-connection pool once and kept, with the
// statements prepared on it.
//
// The shared transaction is not a *sql.Tx: database/sql gives every
// transaction a cancellable context of its own (even one begun with
// context.Background), and each query inside a transaction whose context
// can end starts a goroutine that waits for it (Rows.initContextClose),
// 4 per join with the wake-ups they cause. BEGIN, COMMIT and ROLLBACK are
// statements on the held connection instead, and every statement runs on
// a context whose Done() is nil (batch's, or Tx.stmtCtx's), so none is
// started and none can interrupt a statement.
//
// Only the writer goroutine uses it, and the participant it runs: one at
// a time, each handed over by a channel, so the map needs no lock.
type writerConn struct {
	conn  *sql.Conn
	stmts map[string]*sql.Stmt // rewritten text -> prepared on conn
}

// stmt returns q prepared on the writer connection, preparing it the first
// time, or nil to run q as text (preparing failed: running it reports the
// same error where the statement ran).
func (c *writerConn) stmt(q string) *sql.Stmt {
	if st, ok := c.stmts[q]; ok {
		return st
	}
	st, err := c.conn.PrepareContext(context.Background(), q)
	if err != nil {
		return nil
	}
	c.stmts[q] = st
	return st
}

// close closes the prepared statements and returns the connection to the
// pool; bad discards it for good (database/sql opens a new one), which
// makes SQLite roll back any transaction still open on it.
func (c *writerConn) close(bad bool) error {
	var err error
	for q, st := range c.stmts {
		err = errors.Join(err, st.Close())
		delete(c.stmts, q)
	}
	if bad {
		_ = c.conn.Raw(func(any) error { return driver.ErrBadConn })
	}
	return errors.Join(err, c.conn.Close())
}

// begin begins the shared transaction on the writer connection, taking
// the connection first when the writer holds none.
func (db *DB) begin(ctx context.Context) (*writerConn, error) {
	if db.wc == nil {
		conn, err := db.w.Conn(ctx)
		if err != nil {
			return nil, fmt.Errorf("begin transaction: %w", err)
		}
		db.wc = &writerConn{conn: conn, stmts: map[string]*sql.Stmt{}}
	}
	if _, err := db.wc.conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		// The connection may be inside a transaction nobody ended: drop it.
		db.discardWriter()
		return nil, fmt.Errorf("begin transaction: %w", err)
	}
	return db.wc, nil
}

// end commits (commit) or rolls back the shared transaction.
func (c *writerConn) end(commit bool) error {
	q := "ROLLBACK"
	if commit {
		q = "COMMIT"
	}
	_, err := c.conn.ExecContext(context.Background(), q)
	return err
}

// discardWriter drops the writer connection and its statements: the next
// transaction takes a new one.
func (db *DB) discardWriter() {
	if db.wc != nil {
		_ = db.wc.close(true)
		db.wc = nil
	}
}

// releaseWriter returns the writer connection when the writer stops.
func (db *DB) releaseWriter() {
	if db.wc != nil {
		if err := db.wc.close(false); err != nil {
			db.log.Debug("close the writer connection", "err", err)
		}
		db.wc = nil
	}
}
