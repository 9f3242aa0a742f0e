package store

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// ExecRaw runs one statement in the transaction (tests only: scratch tables,
// slow statements, constraint violations).
func (t *Tx) ExecRaw(ctx context.Context, q string, args ...any) error {
	_, err := t.exec(ctx, q, args...)
	return err
}

// QueryInt reads one integer (tests only).
func (t *Tx) QueryInt(ctx context.Context, q string, args ...any) (int64, error) {
	var n int64
	err := t.queryRow(ctx, q, args...).Scan(&n)
	return n, err
}

// QueuedWrites is how many write transactions wait for SQLite's writer.
func (db *DB) QueuedWrites() int { return db.e.QueuedWrites() }

// WithBusyTimeout sets how long SQLite waits for another process's lock.
func WithBusyTimeout(c Config, d time.Duration) Config {
	c.busyTimeout = d
	return c
}

// WithCheckpoints sets after how many WAL pages, and how often, the
// checkpointer runs (engine/checkpoint.go).
func WithCheckpoints(c Config, pages int64, every time.Duration) Config {
	c.checkpointPages, c.checkpointEvery = pages, every
	return c
}

// WALPagesWritten is how many WAL pages the SQLite writer has appended.
func (db *DB) WALPagesWritten() int64 { return db.e.WALPagesWritten() }

// SetCommitTimeout sets the bound of a PostgreSQL COMMIT.
func (db *DB) SetCommitTimeout(d time.Duration) { db.e.SetCommitTimeout(d) }

// CommandsChannelFor is the commands channel of a schema (notify.go).
var CommandsChannelFor = commandsChannel

// NodesByHardwareKeySQL is NodesByHardwareKey's query text (plan tests).
var NodesByHardwareKeySQL = nodesByHardwareKeySQL

// QueryTexts runs q and returns the last column of each row as text (tests
// only: query plans).
func (t *Tx) QueryTexts(ctx context.Context, q string, args ...any) ([]string, error) {
	rows, err := t.query(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return nil, err
	}
	var out []string
	for rows.Next() {
		vals := make([]any, len(cols))
		for i := range vals {
			vals[i] = new(any)
		}
		if err := rows.Scan(vals...); err != nil {
			return nil, err
		}
		out = append(out, fmt.Sprint(*vals[len(vals)-1].(*any)))
	}
	return out, rows.Err()
}

// RemakeStreamKey deletes the stream key and loads a new one, as on the
// first start of this version on a database an earlier version ran.
func (db *DB) RemakeStreamKey(ctx context.Context) error {
	if err := db.WithTx(ctx, func(tx *Tx) error { return tx.ExecRaw(ctx, "DELETE FROM stream_key") }); err != nil {
		return err
	}
	return db.loadStreamKey(ctx)
}

// MigrationUp returns the Up section of migration file name of d (tests
// only: re-running a backfill on rows written afterwards).
func MigrationUp(d Dialect, name string) (string, error) {
	b, err := migrations.ReadFile("migrations/" + string(d) + "/" + name)
	if err != nil {
		return "", err
	}
	s := string(b)
	up, down := strings.Index(s, "-- +goose Up"), strings.Index(s, "-- +goose Down")
	if up < 0 || down < up {
		return "", fmt.Errorf("%s: no Up section", name)
	}
	return s[up:down], nil
}

// MigrateDownTo rolls db's schema back to version, and MigrateUp brings it
// up again (migration tests).
func (db *DB) MigrateDownTo(ctx context.Context, version int64) error {
	return db.e.MigrateDownTo(ctx, version)
}

// MigrateUp applies every migration not applied yet.
func (db *DB) MigrateUp(ctx context.Context) error { return db.e.MigrateUp(ctx) }

// WithRowsOpen runs q and calls fn while its rows are open (tests only:
// what a running query costs besides the statement).
func (t *Tx) WithRowsOpen(ctx context.Context, q string, fn func()) error {
	rows, err := t.query(ctx, q)
	if err != nil {
		return err
	}
	defer rows.Close()
	fn()
	return rows.Err()
}

// Gaps returns how many holes the feed still looks for (tests only).
func (f *SessionFeed) Gaps() int { return len(f.gaps) }
