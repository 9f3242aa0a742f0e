package controller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Acceptance timing.
const (
	// acceptanceTTL bounds delivery and answer of one acceptance.check.
	acceptanceTTL = 5 * time.Minute
	// acceptanceWait is how long an item waits for a sent command's result
	// before looking again; the result wakes it sooner.
	acceptanceWait = 15 * time.Second
)

// deferred ends a handler without finishing its item: what it wrote
// commits, and the item comes back after `after`.
type deferred struct {
	after  time.Duration
	reason string
}

func (d *deferred) Error() string { return "deferred: " + d.reason }

func waitFor(after time.Duration, reason string) error {
	return &deferred{after: after, reason: reason}
}

// AcceptanceResult is the output of the acceptance.check kind, as bcd
// writes it.
type AcceptanceResult struct {
	Pass   bool              `json:"pass"`
	Checks []AcceptanceCheck `json:"checks"`
}

// AcceptanceCheck is one check of an acceptance.check output.
type AcceptanceCheck struct {
	Name string `json:"name"`
	Want int64  `json:"want"`
	Have int64  `json:"have"`
	Pass bool   `json:"pass"`
}

// accept runs a node's acceptance checks (R4.5, R12.2): it sends the
// node an acceptance.check command with the pool's policy once the node is
// connected, waits for the result, and moves the node to adopted (pass) or
// failed with the failing check as the reason.
func (c *Controller) accept(ctx context.Context, tx *store.Tx, w store.WorkItem) error {
	n, err := tx.GetNode(ctx, w.NodeID)
	if errors.Is(err, store.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if n.State != store.NodeAdopting {
		return nil
	}
	pool, err := tx.GetPool(ctx, n.PoolID)
	if err != nil {
		return err
	}
	policy, err := tenancy.ParsePolicy(pool.Policy)
	if err != nil {
		return err
	}
	if policy.Acceptance == nil {
		// The checks were removed from the pool meanwhile.
		return c.adopt(ctx, tx, n.ID)
	}
	now := c.cfg.Clock.Now()
	cmd, err := tx.LatestCommand(ctx, n.ID, wire.KindAcceptanceCheck)
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return err
	}
	if err == nil && (cmd.State == store.CommandQueued || cmd.State == store.CommandSent) && !now.Before(cmd.ExpiresAt) {
		// Expired by this controller's clock: recorded here, with its
		// event and audit row, in the transaction that sends the next.
		if cmd, err = c.expireCommand(ctx, tx, n, cmd); err != nil {
			return err
		}
	}
	if err == nil && cmd.IdentityGeneration == n.IdentityGeneration {
		switch cmd.State {
		case store.CommandQueued, store.CommandSent:
			return waitFor(min(acceptanceWait, max(cmd.ExpiresAt.Sub(now), time.Second)), "waiting for the acceptance result")
		case store.CommandDone:
			return c.acceptanceOutcome(ctx, tx, n, cmd)
		case store.CommandFailed:
			return c.acceptanceFailed(ctx, tx, n, cmd.ID, "acceptance.check failed: "+cmd.Error)
		}
		// expired: send a new one.
	}
	if n.Connection != store.Connected {
		// The node's next Hello makes this item due at once.
		return waitFor(min(time.Duration(1<<min(w.Attempts, 8))*time.Second, 5*time.Minute), "waiting for the node to connect")
	}
	args, err := json.Marshal(policy.Acceptance)
	if err != nil {
		return fmt.Errorf("marshal acceptance policy: %w", err)
	}
	id := ids.New(ids.Command, now)
	sent := store.Command{ID: id, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Kind: wire.KindAcceptanceCheck,
		Args: args, CreatedAt: now, ExpiresAt: now.Add(acceptanceTTL)}
	if err := tx.InsertCommand(ctx, sent); err != nil {
		return err
	}
	// R14.2: the controller's command is audited as an operator's is.
	if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: actor, Action: "command.enqueued", Resource: nodeResource(n.ID),
		Data: map[string]any{"commandId": id, "nodeId": n.ID, "kind": sent.Kind, "identityGeneration": n.IdentityGeneration,
			"expiresAt": sent.ExpiresAt.UTC().Format(time.RFC3339Nano), "reason": "acceptance"}}); err != nil {
		return err
	}
	if c.cfg.Notify != nil {
		nodeID := n.ID
		tx.AfterCommit(func() { c.cfg.Notify(nodeID) })
	}
	return waitFor(acceptanceWait, "acceptance check sent")
}

// acceptanceOutcome reads an answered acceptance.check.
func (c *Controller) acceptanceOutcome(ctx context.Context, tx *store.Tx, n store.Node, cmd store.Command) error {
	var res AcceptanceResult
	if err := json.Unmarshal(cmd.Result, &res); err != nil || len(res.Checks) == 0 && !res.Pass {
		return c.acceptanceFailed(ctx, tx, n, cmd.ID, "acceptance.check answered no readable result")
	}
	for _, ch := range res.Checks {
		if !ch.Pass {
			return c.acceptanceFailed(ctx, tx, n, cmd.ID, fmt.Sprintf("%s: want at least %d, have %d", ch.Name, ch.Want, ch.Have))
		}
	}
	if !res.Pass {
		return c.acceptanceFailed(ctx, tx, n, cmd.ID, "acceptance.check did not pass")
	}
	// R14.2: the result is recorded with the adoption it causes.
	data := map[string]any{"nodeId": n.ID, "poolId": n.PoolID, "identityGeneration": n.IdentityGeneration, "commandId": cmd.ID, "checks": res.Checks}
	if err := events.Publish(ctx, tx, c.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.acceptance-passed", Subject: n.ID, Data: data}); err != nil {
		return err
	}
	if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: actor, Action: "node.acceptance-passed", Resource: nodeResource(n.ID), Data: data}); err != nil {
		return err
	}
	return c.adopt(ctx, tx, n.ID)
}

// expireCommand marks cmd expired, with the command.expired event and audit
// row (R14.2), and returns it as stored.
func (c *Controller) expireCommand(ctx context.Context, tx *store.Tx, n store.Node, cmd store.Command) (store.Command, error) {
	why := "expired before delivery"
	if cmd.State == store.CommandSent {
		why = "expired without an answer"
	}
	done, err := tx.FinishCommand(ctx, cmd.ID, store.CommandExpired, nil, why)
	if err != nil {
		return cmd, err
	}
	if done {
		data := map[string]any{"commandId": cmd.ID, "nodeId": n.ID, "kind": cmd.Kind, "previousState": cmd.State, "reason": why}
		if err := events.Publish(ctx, tx, c.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "command.expired", Subject: n.ID, Data: data}); err != nil {
			return cmd, err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: actor, Action: "command.expired", Resource: nodeResource(n.ID), Data: data}); err != nil {
			return cmd, err
		}
	}
	// Finished meanwhile (an answer, another replica's sweep): read what
	// it is now.
	return tx.GetCommand(ctx, cmd.ID)
}

// acceptanceFailed moves the node to failed with reason.
func (c *Controller) acceptanceFailed(ctx context.Context, tx *store.Tx, n store.Node, commandID, reason string) error {
	if len(reason) > 512 {
		reason = reason[:512]
	}
	if err := tx.SetNodeState(ctx, n.ID, store.NodeFailed, reason); err != nil {
		return err
	}
	data := map[string]any{"nodeId": n.ID, "poolId": n.PoolID, "identityGeneration": n.IdentityGeneration, "reason": reason, "commandId": commandID}
	if err := events.Publish(ctx, tx, c.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.acceptance-failed", Subject: n.ID, Data: data}); err != nil {
		return err
	}
	return events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: actor, Action: "node.acceptance-failed", Resource: nodeResource(n.ID), Data: data})
}
