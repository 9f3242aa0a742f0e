package engine

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
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
// a context whose Done() is nil (context.Background here, or
// Tx.stmtCtx's), so none is started and none can interrupt a statement.
//
// Every statement (Tx.QueryRow, Tx.Query, Tx.Exec) and the transaction's
// own (BEGIN, SAVEPOINT...) go straight to modernc's driver connection
// (raw), prepared once as a driver.Stmt: no database/sql locking,
// argument conversion, Rows or Stmt bookkeeping per call; rows are
// scanned with database/sql's conversions (row.go). Using raw outside
// conn.Raw is sound here because database/sql touches a held connection
// only in calls made through it, and the writer makes every call, one at
// a time.
//
// Only the writer goroutine uses it, and the participant it runs: one at
// a time, each handed over by a channel, so the maps need no lock.
type writerConn struct {
	conn  *sql.Conn
	raw   rawConn
	rawSt map[string]rawStmt // rewritten text -> prepared on raw
	// walPages is the connection's WAL pages written when the
	// checkpointer last counted them (checkpoint.go).
	walPages int64
}

// rawConn and rawStmt are what the writer needs of modernc's driver
// connection and statements.
type rawConn interface {
	driver.ConnPrepareContext
}

type rawStmt interface {
	driver.Stmt
	driver.StmtExecContext
	driver.StmtQueryContext
}

// newWriterConn takes the writer connection from the pool.
func (db *DB) newWriterConn(ctx context.Context) (*writerConn, error) {
	conn, err := db.w.Conn(ctx)
	if err != nil {
		return nil, err
	}
	var raw rawConn
	if err := conn.Raw(func(dc any) error {
		var ok bool
		if raw, ok = dc.(rawConn); !ok {
			return fmt.Errorf("the SQLite driver's connection %T cannot prepare with a context", dc)
		}
		return nil
	}); err != nil {
		conn.Close()
		return nil, err
	}
	return &writerConn{conn: conn, raw: raw, rawSt: map[string]rawStmt{}}, nil
}

// rawStmt returns q prepared on the driver connection, preparing it the
// first time. A statement that fails to prepare reports the error the
// statement would have.
func (c *writerConn) rawStmt(q string) (rawStmt, error) {
	if st, ok := c.rawSt[q]; ok {
		return st, nil
	}
	ds, err := c.raw.PrepareContext(context.Background(), q)
	if err != nil {
		return nil, err
	}
	st, ok := ds.(rawStmt)
	if !ok {
		ds.Close()
		return nil, fmt.Errorf("the SQLite driver's statement %T cannot run with a context", ds)
	}
	c.rawSt[q] = st
	return st, nil
}

// exec runs q, which returns no rows, on the driver connection.
func (c *writerConn) exec(q string, args ...any) (sql.Result, error) {
	st, err := c.rawStmt(q)
	if err != nil {
		return nil, err
	}
	nv, err := namedValues(args)
	if err != nil {
		return nil, err
	}
	return st.ExecContext(context.Background(), nv)
}

// queryRow runs q on the driver connection and reads its first row.
func (c *writerConn) queryRow(q string, args ...any) *Row {
	rows, err := c.open(q, args)
	if err != nil {
		return &Row{err: err}
	}
	r := &Row{vals: make([]driver.Value, len(rows.Columns()))}
	switch err := rows.Next(r.vals); {
	case err == io.EOF:
		r.vals, r.none = nil, true
	case err != nil:
		r.err = err
	}
	if err := rows.Close(); err != nil && r.err == nil {
		r.err = err
	}
	return r
}

// query runs q on the driver connection and returns its rows, to be read
// and closed before the writer's next statement.
func (c *writerConn) query(q string, args ...any) (Rows, error) {
	rows, err := c.open(q, args)
	if err != nil {
		return nil, err
	}
	return &rawRows{rows: rows, vals: make([]driver.Value, len(rows.Columns()))}, nil
}

// open runs the query q on its prepared statement.
func (c *writerConn) open(q string, args []any) (driver.Rows, error) {
	st, err := c.rawStmt(q)
	if err != nil {
		return nil, err
	}
	nv, err := namedValues(args)
	if err != nil {
		return nil, err
	}
	return st.QueryContext(context.Background(), nv)
}

// close closes the prepared statements (the driver's first, while their
// connection is open) and returns the connection to the pool; bad
// discards it for good (database/sql opens a new one), which makes SQLite
// roll back any transaction still open on it.
func (c *writerConn) close(bad bool) error {
	var err error
	for q, st := range c.rawSt {
		err = errors.Join(err, st.Close())
		delete(c.rawSt, q)
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
		wc, err := db.newWriterConn(ctx)
		if err != nil {
			return nil, fmt.Errorf("begin transaction: %w", err)
		}
		db.wc = wc
	}
	if _, err := db.wc.exec("BEGIN IMMEDIATE"); err != nil {
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
	_, err := c.exec(q)
	return err
}

// committed counts what a commit on wc wrote for the checkpointer.
func (db *DB) committed(wc *writerConn) {
	if db.ckpt != nil {
		db.ckpt.committed(wc)
	}
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
