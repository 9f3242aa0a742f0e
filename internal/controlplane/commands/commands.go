// Package commands owns the operator's side of the command queue (R12.3):
// enqueueing a command for a node, reading commands back with the node's
// answer, and expiring those nobody answered in time. Delivery, signing
// and results belong to the session service (internal/controlplane/session); this
// package only writes the queued row and tells the session service of
// this process (Notify). The node's session may be held by another API
// replica: on PostgreSQL the store notifies every replica from the
// inserting transaction (store/notify.go), so no caller here has to. A
// command waits in the queue while its node has no session, and is
// delivered by the node's next session until it expires. Every command
// ends: Expire ends those nobody delivered (queued) and those delivered
// that nobody answered (sent: a session whose replica died before it put
// them back, on a node that did not come back in time). Only the API
// server imports this package.
//
// SECURITY (R7.5): a kind is queued only when the node's current
// certificate allows it (node_certs.allowed_kinds of the newest unrevoked
// certificate of the node's identity generation; empty allows every kind).
// The session service checks again at dispatch.
package commands

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// TTL bounds.
const (
	DefaultTTL = 10 * time.Minute
	MaxTTL     = 24 * time.Hour
)

const (
	maxKindLen   = 128
	maxArgsBytes = 16 << 10
	// expireBatch bounds one sweep transaction.
	expireBatch = 500
)

// kindRE is the syntax of a command kind: dot-separated lower-case words,
// at least two (node.facts).
var kindRE = regexp.MustCompile(`^[a-z0-9-]+(\.[a-z0-9-]+)+$`)

// BuiltIn reports whether bcd runs kind built in.
func BuiltIn(kind string) bool { return wire.BuiltInKind(kind) }

// Config lists the Service's dependencies.
type Config struct {
	DB  *store.DB
	Hub *events.Hub
	Log *slog.Logger
	// Clock paces RunExpiry (expiry itself is the database's clock); nil
	// means the wall clock.
	Clock clock.Clock
	// Notify, when set, is called after a command committed so the node's
	// session on this replica delivers it at once. A session on another
	// replica learns of it by the store's notification (PostgreSQL), or
	// by its session service's poll.
	Notify func(nodeID string)
	// Metrics, when set, counts commands enqueued and expired.
	Metrics *apimetrics.API
}

// Service enqueues, reads and expires commands.
type Service struct{ cfg Config }

// New returns a Service.
func New(cfg Config) *Service {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	return &Service{cfg: cfg}
}

// ValidKind checks a kind's syntax. Kinds bcd does not know are allowed
// to queue (bcd answers "unknown kind"), so the syntax is all that is
// checked.
func ValidKind(kind string) error {
	switch {
	case kind == "":
		return errs.Invalid("kind", "required")
	case len(kind) > maxKindLen:
		return errs.Invalid("kind", "at most %d characters", maxKindLen)
	case !kindRE.MatchString(kind):
		return errs.Invalid("kind", "%q is not a command kind: want lower-case dot-separated words such as node.facts", kind)
	}
	return nil
}

// nodeFor reads the tenant's node and checks action on it (or on its
// pool). Another tenant's node, and a node a platform principal acting for
// another tenant may not touch, are NOT_FOUND (R1.2).
func nodeFor(ctx context.Context, tx *store.Tx, p authz.Principal, tenantID, nodeID, action string) (store.Node, error) {
	n, err := tx.GetNode(ctx, nodeID)
	if errors.Is(err, store.ErrNotFound) || err == nil && n.TenantID != tenantID {
		return store.Node{}, errs.New(errs.NotFound, "node %s not found", nodeID)
	}
	if err != nil {
		return store.Node{}, err
	}
	if err := allowed(p, tenantID, n, action); err != nil {
		return store.Node{}, err
	}
	return n, nil
}

func allowed(p authz.Principal, tenantID string, n store.Node, action string) error {
	res := "compute-node/" + n.ID
	if p.Allowed(action, res) || p.Allowed(action, authz.PoolResource(n.PoolID)) {
		return nil
	}
	// R1.2: a caller who may not even see the node (read it, or read its
	// commands) gets the answer a missing node gets, so it cannot tell
	// which node ids exist; one who may see it learns only that the action
	// is not granted.
	canRead := false
	for _, a := range []string{authz.NodesRead, authz.CommandsRead} {
		canRead = canRead || p.Allowed(a, res) || p.Allowed(a, authz.PoolResource(n.PoolID))
	}
	if p.TenantID != tenantID || !canRead {
		return errs.New(errs.NotFound, "node %s not found", n.ID)
	}
	return errs.New(errs.AccessDenied, "%s is not allowed on %s", action, res)
}

// Enqueue queues a command of kind with args (a JSON object, or empty)
// for the tenant's node, to be delivered and answered within ttl (0 is
// DefaultTTL). The row, a command.enqueued event and an audit row commit
// together; then the session service is told.
func (s *Service) Enqueue(ctx context.Context, p authz.Principal, tenantID, nodeID, kind string, args []byte, ttl time.Duration) (store.Command, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.Command{}, err
	}
	if nodeID == "" {
		return store.Command{}, errs.Invalid("nodeId", "required")
	}
	if err := ValidKind(kind); err != nil {
		return store.Command{}, err
	}
	switch {
	case ttl == 0:
		ttl = DefaultTTL
	case ttl < time.Second || ttl > MaxTTL:
		return store.Command{}, errs.Invalid("ttlSeconds", "want 1 to %d seconds", int(MaxTTL/time.Second))
	}
	if len(args) == 0 {
		args = []byte("{}")
	}
	if len(args) > maxArgsBytes {
		return store.Command{}, errs.Invalid("args", "at most %d bytes of JSON", maxArgsBytes)
	}
	var cmd store.Command
	err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		n, err := nodeFor(ctx, tx, p, tenantID, nodeID, authz.CommandsCreate)
		if err != nil {
			return err
		}
		if n.State == store.NodeRetired {
			return errs.New(errs.InvalidState, "node %s is retired", n.ID)
		}
		cert, err := tx.CurrentNodeCert(ctx, n.ID, n.IdentityGeneration)
		if errors.Is(err, store.ErrNotFound) {
			return errs.New(errs.InvalidState, "node %s has no unrevoked certificate of its identity generation %d", n.ID, n.IdentityGeneration)
		}
		if err != nil {
			return err
		}
		var kinds []string
		if err := json.Unmarshal(cert.AllowedKinds, &kinds); err != nil && len(cert.AllowedKinds) > 0 {
			return fmt.Errorf("read allowed kinds of %s: %w", cert.Serial, err)
		}
		if !wire.KindAllowed(kinds, kind) {
			return errs.New(errs.InvalidState, "kind %s is not allowed for node %s's certificate (allowed: %s)", kind, n.ID, strings.Join(kinds, ", "))
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		cmd = store.Command{ID: ids.New(ids.Command, now), NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Kind: kind, Args: args,
			State: store.CommandQueued, CreatedAt: now, ExpiresAt: now.Add(ttl)}
		if err := tx.InsertCommand(ctx, cmd); err != nil {
			return err
		}
		data := map[string]any{"commandId": cmd.ID, "nodeId": n.ID, "kind": kind, "builtIn": BuiltIn(kind), "identityGeneration": n.IdentityGeneration,
			"certSerial": cert.Serial, "expiresAt": cmd.ExpiresAt.Format(time.RFC3339Nano)}
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "command.enqueued", Subject: n.ID, Data: data}); err != nil {
			return err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: p.ID, Action: "command.enqueued", Resource: "compute-node/" + n.ID, Data: data}); err != nil {
			return err
		}
		if s.cfg.Notify != nil {
			tx.AfterCommit(func() { s.cfg.Notify(n.ID) })
		}
		return nil
	})
	if err == nil {
		s.cfg.Metrics.Command(telemetry.CommandEnqueued, 1)
	}
	return cmd, err
}

// Get reads a command of one of the tenant's nodes.
func (s *Service) Get(ctx context.Context, p authz.Principal, tenantID, commandID string) (store.Command, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.Command{}, err
	}
	if commandID == "" {
		return store.Command{}, errs.Invalid("commandId", "required")
	}
	var cmd store.Command
	err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		c, err := tx.GetCommand(ctx, commandID)
		if errors.Is(err, store.ErrNotFound) {
			return errs.New(errs.NotFound, "command %s not found", commandID)
		}
		if err != nil {
			return err
		}
		if _, err := nodeFor(ctx, tx, p, tenantID, c.NodeID, authz.CommandsRead); err != nil {
			if errs.Is(err, errs.NotFound) {
				return errs.New(errs.NotFound, "command %s not found", commandID)
			}
			return err
		}
		cmd = c
		return nil
	})
	return cmd, err
}

// List lists the tenant's commands, newest first, optionally of one node.
func (s *Service) List(ctx context.Context, p authz.Principal, tenantID, nodeID, after string, limit int) ([]store.Command, error) {
	if err := p.ActFor(tenantID); err != nil {
		return nil, err
	}
	var out []store.Command
	err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		if nodeID != "" {
			if _, err := nodeFor(ctx, tx, p, tenantID, nodeID, authz.CommandsRead); err != nil {
				return err
			}
		} else if res := authz.PoolResource("*"); !p.Allowed(authz.CommandsRead, res) {
			if p.TenantID != tenantID {
				return errs.New(errs.NotFound, "tenant %s not found", tenantID)
			}
			return errs.New(errs.AccessDenied, "%s is not allowed on %s", authz.CommandsRead, res)
		}
		var err error
		out, err = tx.ListCommands(ctx, tenantID, nodeID, after, limit)
		return err
	})
	return out, err
}

// Expire marks queued and sent commands whose expiry passed (by the
// database clock) as expired, each with a command.expired event, and
// returns how many it expired.
func (s *Service) Expire(ctx context.Context) (int, error) {
	total := 0
	for {
		n, more := 0, false
		err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
			n = 0
			due, err := tx.DueCommands(ctx, expireBatch)
			if err != nil {
				return err
			}
			more = len(due) == expireBatch
			for _, d := range due {
				why := "expired before delivery"
				if d.State == store.CommandSent {
					why = "expired without an answer"
				}
				done, err := tx.FinishCommand(ctx, d.ID, store.CommandExpired, nil, why)
				if err != nil || !done {
					return err
				}
				n++
				// A controller waiting for this command (acceptance) looks again.
				if err := tx.WakeNodeWork(ctx, d.NodeID); err != nil {
					return err
				}
				data := map[string]any{"commandId": d.ID, "nodeId": d.NodeID, "kind": d.Kind, "previousState": d.State, "reason": why}
				if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: d.TenantID, Type: "command.expired", Subject: d.NodeID, Data: data}); err != nil {
					return err
				}
				// R14.2: the command finished without an answer.
				if err := events.Audit(ctx, tx, events.Entry{TenantID: d.TenantID, Actor: "system", Action: "command.expired", Resource: "compute-node/" + d.NodeID, Data: data}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return total, fmt.Errorf("expire commands: %w", err)
		}
		total += n
		s.cfg.Metrics.Command(telemetry.CommandExpired, n)
		if !more {
			return total, nil
		}
	}
}

// ExpireEvery is how often RunExpiry sweeps.
const ExpireEvery = 5 * time.Second

// RunExpiry runs Expire every ExpireEvery until ctx ends (server.Run starts
// it beside the controller).
func (s *Service) RunExpiry(ctx context.Context) {
	t := s.cfg.Clock.NewTicker(ExpireEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			if n, err := s.Expire(ctx); err != nil && ctx.Err() == nil {
				s.cfg.Log.Error("expire commands", "err", err)
			} else if n > 0 {
				s.cfg.Log.Info("commands expired", "count", n)
			}
		}
	}
}
