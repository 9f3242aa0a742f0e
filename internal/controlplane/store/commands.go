package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Command states (commands.state).
const (
	CommandQueued  = "queued"
	CommandSent    = "sent"
	CommandDone    = "done"
	CommandFailed  = "failed"
	CommandExpired = "expired"
)

// Command is a commands row.
type Command struct {
	ID                 string
	NodeID             string
	IdentityGeneration int
	Kind               string
	Args               []byte // JSON
	State              string
	Result             []byte // JSON output of the kind
	Error              string
	CreatedAt          time.Time
	ExpiresAt          time.Time
	SentAt             *time.Time
	FinishedAt         *time.Time
}

const commandCols = "id, node_id, identity_generation, kind, args, state, result, error, created_ms, expires_ms, sent_ms, finished_ms"

func scanCommand(sc interface{ Scan(...any) error }) (Command, error) {
	var c Command
	var args, result string
	var created, expires int64
	var sent, finished sql.NullInt64
	if err := sc.Scan(&c.ID, &c.NodeID, &c.IdentityGeneration, &c.Kind, &args, &c.State, &result, &c.Error, &created, &expires, &sent, &finished); err != nil {
		return Command{}, err
	}
	c.Args, c.Result = []byte(args), []byte(result)
	c.CreatedAt, c.ExpiresAt, c.SentAt, c.FinishedAt = fromMS(created), fromMS(expires), fromNullMS(sent), fromNullMS(finished)
	return c, nil
}

// InsertCommand queues a command; CreatedAt and ExpiresAt are the caller's.
// Once the transaction commits, the node's session is told on whichever
// replica holds it (notify.go).
func (t *Tx) InsertCommand(ctx context.Context, c Command) error {
	if len(c.Args) == 0 {
		c.Args = []byte("{}")
	}
	_, err := t.exec(ctx, "INSERT INTO commands (id, node_id, identity_generation, kind, args, state, created_ms, expires_ms) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?)",
		c.ID, c.NodeID, c.IdentityGeneration, c.Kind, string(c.Args), ms(c.CreatedAt), ms(c.ExpiresAt))
	if err != nil {
		return fmt.Errorf("insert command: %w", err)
	}
	return t.commandsQueued(ctx, c.NodeID)
}

// GetCommand reads a command.
func (t *Tx) GetCommand(ctx context.Context, id string) (Command, error) {
	c, err := scanCommand(t.queryRow(ctx, "SELECT "+commandCols+" FROM commands WHERE id = ?", id))
	return c, notFound(err)
}

// LatestCommand returns the node's newest command of kind.
func (t *Tx) LatestCommand(ctx context.Context, nodeID, kind string) (Command, error) {
	c, err := scanCommand(t.queryRow(ctx, "SELECT "+commandCols+" FROM commands WHERE node_id = ? AND kind = ? ORDER BY created_ms DESC, id DESC LIMIT 1", nodeID, kind))
	return c, notFound(err)
}

// QueuedCommands lists a node's queued commands, oldest first.
func (t *Tx) QueuedCommands(ctx context.Context, nodeID string, limit int) ([]Command, error) {
	rows, err := t.query(ctx, "SELECT "+commandCols+" FROM commands WHERE node_id = ? AND state = 'queued' ORDER BY created_ms, id LIMIT ?", nodeID, limit)
	if err != nil {
		return nil, fmt.Errorf("queued commands: %w", err)
	}
	defer rows.Close()
	var out []Command
	for rows.Next() {
		c, err := scanCommand(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// NodesWithQueuedCommands lists the nodes that have queued commands.
func (t *Tx) NodesWithQueuedCommands(ctx context.Context, limit int) ([]string, error) {
	rows, err := t.query(ctx, "SELECT DISTINCT node_id FROM commands WHERE state = 'queued' LIMIT ?", limit)
	if err != nil {
		return nil, fmt.Errorf("nodes with queued commands: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, rows.Err()
}

// MarkCommandSent moves a queued command to sent; false when it was not
// queued any more (another replica sent it).
func (t *Tx) MarkCommandSent(ctx context.Context, id string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE commands SET state = 'sent', sent_ms = compute_now() WHERE id = ? AND state = 'queued'", id)
	if err != nil {
		return false, fmt.Errorf("mark command sent: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// FinishCommand records a command's outcome (done, failed or expired)
// unless it already finished; it reports whether it did.
func (t *Tx) FinishCommand(ctx context.Context, id, state string, result []byte, errText string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE commands SET state = ?, result = ?, error = ?, finished_ms = compute_now() WHERE id = ? AND state IN ('queued', 'sent')",
		state, string(result), errText, id)
	if err != nil {
		return false, fmt.Errorf("finish command: %w", err)
	}
	n, err := res.RowsAffected()
	return n == 1, err
}

// ExpireCommands marks a node's unfinished commands whose expiry passed at
// now as expired.
func (t *Tx) ExpireCommands(ctx context.Context, nodeID string, now time.Time) error {
	_, err := t.exec(ctx, "UPDATE commands SET state = 'expired', finished_ms = compute_now() WHERE node_id = ? AND state IN ('queued', 'sent') AND expires_ms <= ?", nodeID, ms(now))
	return err
}

// FailPendingCommands fails a node's queued and sent commands with errText
// and returns their ids.
func (t *Tx) FailPendingCommands(ctx context.Context, nodeID, errText string) ([]string, error) {
	rows, err := t.query(ctx, "SELECT id FROM commands WHERE node_id = ? AND state IN ('queued', 'sent') ORDER BY id", nodeID)
	if err != nil {
		return nil, fmt.Errorf("find pending commands: %w", err)
	}
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			rows.Close()
			return nil, err
		}
		ids = append(ids, id)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(ids) == 0 {
		return nil, nil
	}
	if _, err := t.exec(ctx, "UPDATE commands SET state = 'failed', error = ?, finished_ms = compute_now() WHERE node_id = ? AND state IN ('queued', 'sent')", errText, nodeID); err != nil {
		return nil, fmt.Errorf("fail pending commands: %w", err)
	}
	return ids, nil
}
