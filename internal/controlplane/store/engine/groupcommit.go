package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
)

// maxBatch bounds how many write transactions share one SQLite commit.
const maxBatch = 64

// writeReq is one write transaction waiting for the SQLite writer.
type writeReq struct {
	ctx  context.Context
	fn   func(*Tx) error
	done chan error // buffered: the writer never waits for the caller
}

// member is a participant of a batch whose function succeeded: it commits
// with the batch.
type member struct {
	r *writeReq
	t *Tx
}

// errBrokenBatch means the shared transaction can no longer be trusted (a
// savepoint statement failed), so nothing of it is committed.
var errBrokenBatch = errors.New("shared transaction broken")

// writer owns SQLite's single writer connection and groups concurrent write
// transactions into one commit ("group commit"). Each transaction runs inside
// its own SAVEPOINT: when its function fails, only its statements are rolled
// back and its caller gets the error at once; the others commit together.
// Under load this turns N commits (each writing every touched page to the
// WAL) into one, which is most of what a join costs SQLite.
//
// Every participant learns its exact outcome:
//   - a participant's context never interrupts a statement (Tx.stmtCtx):
//     SQLite answers an interrupted write by rolling back the whole
//     transaction, everyone's work included, and the statements after it
//     would then run outside any transaction;
//   - one whose function fails, panics or leaves its goroutine is rolled
//     back to its own savepoint and told so before the others commit;
//   - the others are told nil only after the shared COMMIT succeeded;
//   - when the COMMIT fails, or a savepoint statement fails so that the
//     shared transaction is in doubt, nothing of the batch is committed
//     (the connection is discarded, which rolls back whatever is open) and
//     each participant that had succeeded runs again alone, in its own
//     transaction, so that one participant's fault (a deferred constraint,
//     say) is reported to it and not to everyone;
//   - a failed BEGIN is reported to the one transaction that waited for it.
//
// Transactions are taken one at a time; a batch forms only from those
// already waiting, so a lone write is never delayed.
func (db *DB) writer() {
	defer close(db.writerDone)
	defer db.releaseWriter()
	for req := range db.writes {
		db.batch(req)
	}
}

// batch runs first and whatever waits behind it as one transaction.
func (db *DB) batch(first *writeReq) {
	wc, err := db.begin(context.Background())
	if err != nil {
		first.done <- err
		return
	}
	var ok []member
	broken := false
	run := func(r *writeReq) {
		t := &Tx{db: db, wc: wc, shared: true}
		err, serr := t.savepoint(r.ctx, r.fn)
		if serr != nil {
			db.log.Error("group commit: savepoint failed; the batch runs again one by one", "err", serr)
			broken = true
		}
		switch {
		case err != nil:
			// Rolled back to its savepoint, or with the whole batch when
			// that failed: either way none of it commits.
			r.done <- err
		case serr != nil:
			// fn succeeded but its savepoint could not be released: run it
			// again alone.
			ok = append(ok, member{r: r})
		default:
			ok = append(ok, member{r: r, t: t})
		}
	}
	run(first)
	for n := 1; n < maxBatch && !broken; n++ {
		r, more := db.waiting()
		if !more {
			break
		}
		run(r)
	}
	var cerr error
	switch {
	case broken:
		cerr = errBrokenBatch
	case len(ok) == 0:
		if cerr = wc.end(false); cerr == nil {
			return
		}
	default:
		cerr = wc.end(true)
	}
	if cerr != nil {
		// Nothing of the batch committed: a failed COMMIT is rolled back
		// by SQLite or leaves the transaction open, and discarding the
		// connection rolls back whatever is open.
		db.log.Warn("group commit failed; its transactions run again one by one", "err", cerr, "transactions", len(ok))
		db.discardWriter()
		for _, m := range ok {
			db.alone(m.r)
		}
		return
	}
	// Each transaction's hooks run before its caller is answered, as on
	// PostgreSQL: what a hook wakes (the work queue, the event hub) has
	// been woken when WithTx returns.
	for _, m := range ok {
		m.t.committed()
		m.r.done <- nil
	}
	// After the answers: a checkpoint due now does not delay them.
	db.committed(wc)
}

// waiting returns a write transaction already waiting, if any.
func (db *DB) waiting() (*writeReq, bool) {
	select {
	case r, open := <-db.writes:
		return r, open
	default:
		return nil, false
	}
}

// alone runs r in a transaction of its own and reports its outcome.
func (db *DB) alone(r *writeReq) {
	wc, err := db.begin(context.Background())
	if err != nil {
		r.done <- err
		return
	}
	t := &Tx{db: db, wc: wc, shared: true}
	err, serr := t.savepoint(r.ctx, r.fn)
	if err != nil || serr != nil {
		if rerr := wc.end(false); rerr != nil || serr != nil {
			db.discardWriter()
		}
		if err == nil {
			err = fmt.Errorf("%w: %w", errBrokenBatch, serr)
		}
		r.done <- err
		return
	}
	if err := wc.end(true); err != nil {
		db.discardWriter()
		r.done <- fmt.Errorf("commit: %w", err)
		return
	}
	t.committed()
	r.done <- nil
	db.committed(wc)
}

// savepoint runs fn inside a savepoint of the shared transaction, rolling
// back to it when fn fails, panics or exits its goroutine (a test's
// t.Fatal). fn runs on a goroutine of its own so that nothing it does can
// stop the writer. err is fn's outcome; serr says the savepoint statements
// themselves failed, after which the shared transaction is in doubt.
func (t *Tx) savepoint(ctx context.Context, fn func(*Tx) error) (err, serr error) {
	if err := ctx.Err(); err != nil {
		return err, nil
	}
	if _, err := t.wc.exec("SAVEPOINT w"); err != nil {
		return fmt.Errorf("savepoint: %w", err), err
	}
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
	err = <-res
	if err != nil {
		if _, rerr := t.wc.exec("ROLLBACK TO w"); rerr != nil {
			serr = fmt.Errorf("rollback to savepoint: %w", rerr)
		}
	}
	if _, rerr := t.wc.exec("RELEASE w"); rerr != nil && serr == nil {
		serr = fmt.Errorf("release savepoint: %w", rerr)
	}
	return err, serr
}

// submit hands a write transaction to the writer and waits for its outcome.
// After Close it answers ErrClosed: Close closes writes under closeMu,
// which every send holds for reading.
func (db *DB) submit(ctx context.Context, fn func(*Tx) error) error {
	r := &writeReq{ctx: ctx, fn: fn, done: make(chan error, 1)}
	db.closeMu.RLock()
	if db.closed {
		db.closeMu.RUnlock()
		return ErrClosed
	}
	select {
	case db.writes <- r:
	case <-ctx.Done():
		db.closeMu.RUnlock()
		return ctx.Err()
	}
	db.closeMu.RUnlock()
	// Once taken, the outcome must be awaited: the transaction may commit.
	return <-r.done
}
