package store

import (
	"context"
	"fmt"
	"runtime/debug"
)

// maxBatch bounds how many write transactions share one SQLite commit.
const maxBatch = 64

// writeReq is one write transaction waiting for the SQLite writer.
type writeReq struct {
	ctx  context.Context
	fn   func(*Tx) error
	done chan error
}

// writer owns SQLite's single writer connection and groups concurrent write
// transactions into one commit ("group commit"). Each transaction runs inside
// its own SAVEPOINT: when its function fails, only its statements are rolled
// back and its caller gets the error at once; the others commit together.
// Under load this turns N commits (each writing every touched page to the
// WAL) into one, which is most of what a join costs SQLite. A transaction
// that commits reports success only after the shared COMMIT succeeded.
//
// Transactions are taken one at a time; a batch forms only from those
// already waiting, so a lone write is never delayed.
func (db *DB) writer() {
	for req := range db.writes {
		batch := []*writeReq{req}
		stx, err := db.w.BeginTx(context.Background(), nil)
		if err != nil {
			req.done <- fmt.Errorf("begin transaction: %w", err)
			continue
		}
		var committed []*Tx
		var waiting []*writeReq
		var txs []*Tx
		run := func(r *writeReq) {
			t := &Tx{db: db, tx: stx, stmts: db.wStmts}
			txs = append(txs, t)
			if err := t.savepoint(r.ctx, r.fn); err != nil {
				r.done <- err
				return
			}
			committed = append(committed, t)
			waiting = append(waiting, r)
		}
		run(req)
	drain:
		for len(batch) < maxBatch {
			select {
			case r, ok := <-db.writes:
				if !ok {
					break drain
				}
				batch = append(batch, r)
				run(r)
			default:
				break drain
			}
		}
		var cerr error
		if len(waiting) == 0 {
			cerr = stx.Rollback()
		} else if err := stx.Commit(); err != nil {
			cerr = fmt.Errorf("commit: %w", err)
		}
		for i, r := range waiting {
			if cerr == nil {
				for _, f := range committed[i].after {
					f()
				}
			}
			r.done <- cerr
		}
		// The connection is free again: prepare what ran as text.
		for _, t := range txs {
			t.prepareUnprepared(context.Background())
		}
	}
}

// savepoint runs fn inside a savepoint of the shared transaction, rolling
// back to it when fn fails, panics or exits its goroutine (a test's
// t.Fatal). fn runs on a goroutine of its own so that nothing it does can
// stop the writer.
func (t *Tx) savepoint(ctx context.Context, fn func(*Tx) error) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	if _, err := t.tx.ExecContext(context.Background(), "SAVEPOINT w"); err != nil {
		return fmt.Errorf("savepoint: %w", err)
	}
	defer func() {
		if err != nil {
			if _, rerr := t.tx.ExecContext(context.Background(), "ROLLBACK TO w"); rerr != nil {
				t.db.log.Error("rollback to savepoint", "err", rerr)
			}
		}
		if _, rerr := t.tx.ExecContext(context.Background(), "RELEASE w"); rerr != nil && err == nil {
			err = fmt.Errorf("release savepoint: %w", rerr)
		}
	}()
	res := make(chan error, 1)
	go func() {
		returned := false
		defer func() {
			if p := recover(); p != nil {
				res <- fmt.Errorf("panic in transaction: %v\n%s", p, debug.Stack())
			} else if !returned {
				res <- fmt.Errorf("transaction function exited without returning")
			}
		}()
		e := fn(t)
		returned = true
		res <- e
	}()
	return <-res
}

// submit hands a write transaction to the writer and waits for its outcome.
func (db *DB) submit(ctx context.Context, fn func(*Tx) error) error {
	r := &writeReq{ctx: ctx, fn: fn, done: make(chan error, 1)}
	select {
	case db.writes <- r:
	case <-ctx.Done():
		return ctx.Err()
	}
	// Once taken, the outcome must be awaited: the transaction may commit.
	return <-r.done
}
