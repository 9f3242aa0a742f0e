package store

import (
	"context"
	"fmt"
)

// ListCommands lists a tenant's commands, optionally of one node, newest
// first; after is the last id of the previous page.
func (t *Tx) ListCommands(ctx context.Context, tenantID, nodeID, after string, limit int) ([]Command, error) {
	q := "SELECT " + qualify("c", commandCols) + " FROM commands c JOIN nodes n ON n.id = c.node_id WHERE n.tenant_id = ?"
	args := []any{tenantID}
	if nodeID != "" {
		q += " AND c.node_id = ?"
		args = append(args, nodeID)
	}
	if after != "" {
		q += " AND c.id < ?"
		args = append(args, after)
	}
	q += " ORDER BY c.id DESC LIMIT ?"
	args = append(args, limit)
	return t.commands(ctx, "list commands", q, args...)
}

// DueCommand is an unfinished command whose expiry passed, with its node's
// tenant (for the command.expired event).
type DueCommand struct {
	Command
	TenantID string
}

// DueCommands lists queued or sent commands whose expiry passed by the
// database clock, oldest expiry first.
func (t *Tx) DueCommands(ctx context.Context, limit int) ([]DueCommand, error) {
	rows, err := t.query(ctx, "SELECT "+qualify("c", commandCols)+", n.tenant_id FROM commands c JOIN nodes n ON n.id = c.node_id WHERE c.state IN ('queued', 'sent') AND c.expires_ms <= compute_now() ORDER BY c.expires_ms, c.id LIMIT ?", limit)
	if err != nil {
		return nil, fmt.Errorf("due commands: %w", err)
	}
	defer rows.Close()
	var out []DueCommand
	for rows.Next() {
		var d DueCommand
		var tenant string
		c, err := scanCommand(scanFunc(func(dest ...any) error { return rows.Scan(append(dest, &tenant)...) }))
		if err != nil {
			return nil, err
		}
		d.Command, d.TenantID = c, tenant
		out = append(out, d)
	}
	return out, rows.Err()
}

type scanFunc func(...any) error

func (f scanFunc) Scan(dest ...any) error { return f(dest...) }

func (t *Tx) commands(ctx context.Context, what, q string, args ...any) ([]Command, error) {
	rows, err := t.query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
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
