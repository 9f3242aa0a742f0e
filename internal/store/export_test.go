package store

import (
	"context"
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
func (db *DB) QueuedWrites() int { return len(db.writes) }

// WithBusyTimeout sets how long SQLite waits for another process's lock.
func WithBusyTimeout(c Config, d time.Duration) Config {
	c.busyTimeout = d
	return c
}

// SetCommitTimeout sets the bound of a PostgreSQL COMMIT.
func (db *DB) SetCommitTimeout(d time.Duration) { db.commitTimeout = d }

// CommandsChannelFor is the commands channel of a schema (notify.go).
var CommandsChannelFor = commandsChannel
