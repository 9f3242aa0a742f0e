package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// Command notifications (PostgreSQL). A node's session lives in the memory
// of one API replica, and a command for it may be queued on any other. So
// every statement of this package that makes a command queued (a new
// command, a sent one put back) also runs pg_notify(channel, node_id) in
// the same transaction, here and nowhere else, so no caller can forget it.
// PostgreSQL delivers a notification only when its transaction commits,
// once per (channel, payload) per transaction, to every connection that
// LISTENs on the channel: a rolled-back command wakes nobody, and a
// listener that is told reads a committed row. Each replica holds one
// such connection (ListenCommands; internal/controlplane/session's Listener runs it).
//
// Notifications sent while no connection listened are lost, never queued
// for later: the listener scans the queue whenever it (re)connects.
//
// On SQLite there is one process, and the writers tell the session service
// in-process (Notify); nothing is sent.

// listenAppName is the application_name of the listening connection (when
// the DSN sets none), so an operator finds it in pg_stat_activity.
const listenAppName = "better-compute-listen"

// maxChannelLen is PostgreSQL's identifier limit (NAMEDATALEN - 1): a
// longer channel name is refused by pg_notify and cut short by LISTEN.
const maxChannelLen = 63

// commandsChannel names the channel of one schema's command
// notifications. Channels belong to the database, not to a schema: two
// deployments (or two test schemas) in one database must not wake each
// other's sessions, so the schema is in the name, hashed when the name
// would be too long.
func commandsChannel(schema string) string {
	ch := "bc_commands." + schema
	if len(ch) <= maxChannelLen {
		return ch
	}
	sum := sha256.Sum256([]byte(schema))
	return "bc_commands." + hex.EncodeToString(sum[:16])
}

// CommandsChannel is the PostgreSQL channel of this database's command
// notifications ("" on SQLite).
func (db *DB) CommandsChannel() string { return db.channel }

// commandsQueued announces, when the transaction commits, that the node
// has queued commands. On PostgreSQL the statement is held back and sent
// with the transaction's next one (engine/pipeline.go): it costs no round trip.
func (t *Tx) commandsQueued(ctx context.Context, nodeID string) error {
	if t.db.dialect != Postgres {
		return nil
	}
	if err := t.execLater(ctx, "SELECT pg_notify(?, ?)", t.db.channel, nodeID); err != nil {
		return fmt.Errorf("notify queued commands: %w", err)
	}
	return nil
}

// ErrNoListen is ListenCommands' answer on SQLite, where one process holds
// every session and writers notify it in-process.
var ErrNoListen = errs.New(errs.InvalidState, "command notifications need PostgreSQL")

// CommandListener is one connection that LISTENs for command
// notifications. It is not one of the pool's connections: it is held for
// as long as the replica runs, and it must stay out of any transaction
// (a listener inside one gets nothing until it ends). Not safe for
// concurrent use.
type CommandListener struct {
	conn    *pgx.Conn
	channel string
}

// CanListen says whether ListenCommands works here: PostgreSQL tells every
// replica of a queued command; SQLite (one process) tells in-process only.
func (db *DB) CanListen() bool { return db.dialect == Postgres }

// ListenCommands opens a dedicated connection to the database and LISTENs
// on its commands channel. Close it when done.
func (db *DB) ListenCommands(ctx context.Context) (*CommandListener, error) {
	if db.dialect != Postgres {
		return nil, ErrNoListen
	}
	cfg, err := pgx.ParseConfig(db.dsn)
	if err != nil {
		return nil, fmt.Errorf("listen for commands: %w", err)
	}
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = listenAppName
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("listen for commands: connect: %w", err)
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{db.channel}.Sanitize()); err != nil {
		_ = conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("listen for commands: %w", err)
	}
	return &CommandListener{conn: conn, channel: db.channel}, nil
}

// Next waits for the next notification and returns its node id. When ctx
// ends first it returns ctx's error and the connection stays usable (pgx
// interrupts the wait with a read deadline); any other error means the
// connection is gone.
func (l *CommandListener) Next(ctx context.Context) (string, error) {
	for {
		n, err := l.conn.WaitForNotification(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return "", ctx.Err()
			}
			return "", fmt.Errorf("wait for command notifications: %w", err)
		}
		if n.Channel == l.channel {
			return n.Payload, nil
		}
	}
}

// Ping checks that the connection still reaches the database: one that
// broke without a TCP reset would otherwise wait in Next forever while
// notifications went to nobody.
func (l *CommandListener) Ping(ctx context.Context) error {
	if err := l.conn.Ping(ctx); err != nil {
		return fmt.Errorf("ping the command listener's connection: %w", err)
	}
	return nil
}

// PID is the connection's backend process id (pg_stat_activity.pid).
func (l *CommandListener) PID() uint32 { return l.conn.PgConn().PID() }

// Close closes the connection, which ends its LISTEN.
func (l *CommandListener) Close(ctx context.Context) error {
	err := l.conn.Close(ctx)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
