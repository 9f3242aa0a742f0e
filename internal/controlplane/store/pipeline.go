package store

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// Pipelined writes (PostgreSQL). A write transaction's inserts whose
// outcome nothing reads before the commit (a certificate row, the
// authorization projection, a queue item, an event, an audit row) are held
// back (execLater) and sent together with the transaction's next statement
// as one pgx batch: one round trip instead of one each. Nothing is lost or
// reordered: every statement still runs in order inside the transaction,
// before any later read and before COMMIT, so a read sees them and a
// failure of one fails the transaction like any failed statement (the
// error of a held-back statement is the transaction's error, whatever fn
// made of it). On SQLite, in process, every statement runs at once.

// queued is a held-back statement, already rewritten for the dialect.
type queued struct {
	q    string
	args []any
}

// execLater runs q now on SQLite, and on PostgreSQL with the transaction's
// next statement (or before its COMMIT). Only for statements whose result
// no caller needs and whose failure is the transaction's failure.
func (t *Tx) execLater(ctx context.Context, q string, args ...any) error {
	if t.conn == nil {
		_, err := t.exec(ctx, q, args...)
		return err
	}
	if t.err != nil {
		return t.err
	}
	t.later = append(t.later, queued{q: t.db.rewrite(q), args: args})
	return nil
}

// pipeline sends the held-back statements and then q (when not empty) in
// one batch, returning q's result. A held-back statement's failure is
// recorded as the transaction's error (t.err).
func (t *Tx) pipeline(ctx context.Context, q string, args ...any) (sql.Result, error) {
	later := t.later
	t.later = nil
	b := &pgx.Batch{}
	for _, s := range later {
		b.Queue(s.q, s.args...)
	}
	if q != "" {
		b.Queue(q, args...)
	}
	var res sql.Result
	err := t.conn.Raw(func(dc any) error {
		br := dc.(*stdlib.Conn).Conn().SendBatch(ctx, b)
		for i := range later {
			if _, err := br.Exec(); err != nil {
				_ = br.Close()
				t.err = fmt.Errorf("%s: %w", statementName(later[i].q), err)
				return t.err
			}
		}
		if q != "" {
			tag, err := br.Exec()
			if err != nil {
				_ = br.Close()
				return err
			}
			res = tagResult(tag)
		}
		return br.Close()
	})
	return res, err
}

// flush sends the held-back statements, before a read or the COMMIT.
func (t *Tx) flush(ctx context.Context) error {
	if t.err != nil {
		return t.err
	}
	if len(t.later) == 0 {
		return nil
	}
	_, err := t.pipeline(ctx, "")
	return err
}

// tagResult is a batch statement's result as database/sql's.
type tagResult pgconn.CommandTag

func (r tagResult) LastInsertId() (int64, error) {
	return 0, fmt.Errorf("LastInsertId is not supported by PostgreSQL")
}

func (r tagResult) RowsAffected() (int64, error) { return pgconn.CommandTag(r).RowsAffected(), nil }

// statementName is how an error names a held-back statement: its first
// words (INSERT INTO table).
func statementName(q string) string {
	n, words := 0, 0
	for n < len(q) && words < 3 {
		if q[n] == ' ' {
			words++
		}
		n++
	}
	return q[:n]
}
