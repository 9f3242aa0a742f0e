package engine

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Pipelined writes (PostgreSQL). A write transaction's inserts whose
// outcome nothing reads before the commit (a certificate row, the
// authorization projection, a queue item, an event, an audit row) are held
// back (ExecLater) and sent together with the transaction's next statement
// as one pgx batch: one round trip instead of one each. Nothing is lost or
// reordered: every statement still runs in order inside the transaction,
// before any later read and before COMMIT, so a read sees them and a
// failure of one fails the transaction like any failed statement (the
// error of a held-back statement is the transaction's error, whatever fn
// made of it). BEGIN itself is held back the same way (pgtx.go), so the
// first statement carries it; a one-row query carries what is held back
// too (pipelineRow). On SQLite, in process, every statement runs at once.

// queued is a held-back statement, already rewritten for the dialect.
// name, when set, is how its failure is reported, and rows >= 0 the rows
// it must affect, or it fails with wrong.
type queued struct {
	q     string
	args  []any
	name  string
	rows  int64
	wrong error
}

// ExecLater runs q now on SQLite, and on PostgreSQL with the transaction's
// next statement (or before its COMMIT). Only for statements whose result
// no caller needs and whose failure is the transaction's failure.
func (t *Tx) ExecLater(ctx context.Context, q string, args ...any) error {
	if t.pg == nil {
		_, err := t.Exec(ctx, q, args...)
		return err
	}
	if t.err != nil {
		return t.err
	}
	t.later = append(t.later, queued{q: t.db.rewrite(q), args: args, rows: -1})
	return nil
}

// ExecLaterRows is ExecLater for a statement that must affect exactly rows
// rows, failing with "name: wrong" otherwise (an upsert that left a live
// row alone, say). On PostgreSQL that is checked when the batch it goes
// with runs, and its failure is the transaction's, as for ExecLater; its
// other failures are reported as "name: err".
func (t *Tx) ExecLaterRows(ctx context.Context, name string, rows int64, wrong error, q string, args ...any) error {
	if t.pg == nil {
		res, err := t.Exec(ctx, q, args...)
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if n != rows {
			return fmt.Errorf("%s: %w", name, wrong)
		}
		return nil
	}
	if t.err != nil {
		return t.err
	}
	t.later = append(t.later, queued{q: t.db.rewrite(q), args: args, name: name, rows: rows, wrong: wrong})
	return nil
}

// pipeline sends the held-back statements and then q (when not empty) in
// one batch, returning q's result. A held-back statement's failure is
// recorded as the transaction's error (t.err).
func (t *Tx) pipeline(ctx context.Context, q string, args ...any) (sql.Result, error) {
	b := t.batch()
	if q != "" {
		b.Queue(q, args...)
	}
	br := t.pg.SendBatch(ctx, b)
	if err := t.heldBack(br); err != nil {
		_ = br.Close()
		return nil, err
	}
	var res sql.Result
	if q != "" {
		tag, err := br.Exec()
		if err != nil {
			_ = br.Close()
			return nil, err
		}
		res = tagResult(tag)
	}
	return res, br.Close()
}

// pipelineRow sends the held-back statements and then the one-row query q
// in one batch; its row is read when scanned.
func (t *Tx) pipelineRow(ctx context.Context, q string, args ...any) *Row {
	b := t.batch()
	b.Queue(q, args...)
	br := t.pg.SendBatch(ctx, b)
	if err := t.heldBack(br); err != nil {
		_ = br.Close()
		return &Row{err: err}
	}
	rows, err := br.Query()
	if err != nil {
		if rows != nil {
			rows.Close()
		}
		_ = br.Close()
		return &Row{err: err}
	}
	r := &Row{pg: rows, br: br}
	t.open = r
	return r
}

// batch is a batch of what is held back: BEGIN when it has not been
// sent, then the held-back statements, which it takes from t.
func (t *Tx) batch() *pgx.Batch {
	b := &pgx.Batch{}
	if t.begin {
		if t.readOnly {
			b.Queue("BEGIN READ ONLY")
		} else {
			b.Queue("BEGIN")
		}
	}
	for _, s := range t.later {
		b.Queue(s.q, s.args...)
	}
	return b
}

// heldBack reads the results of batch's BEGIN and held-back statements
// from br, recording a failure as the transaction's error.
func (t *Tx) heldBack(br pgx.BatchResults) error {
	later := t.later
	t.later = nil
	if t.begin {
		// Sent: from here the transaction is rolled back or committed,
		// whatever its answer.
		t.begin = false
		if _, err := br.Exec(); err != nil {
			t.err = fmt.Errorf("begin transaction: %w", err)
			return t.err
		}
	}
	for _, s := range later {
		tag, err := br.Exec()
		name := s.name
		if name == "" {
			name = statementName(s.q)
		}
		switch {
		case err != nil:
			t.err = fmt.Errorf("%s: %w", name, err)
		case s.rows >= 0 && tag.RowsAffected() != s.rows:
			t.err = fmt.Errorf("%s: %w", name, s.wrong)
		}
		if t.err != nil {
			return t.err
		}
	}
	return nil
}

// flush sends the held-back statements, before a read or the COMMIT.
func (t *Tx) flush(ctx context.Context) error {
	t.settle()
	if t.err != nil {
		return t.err
	}
	if !t.begin && len(t.later) == 0 {
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
