// Package controller runs the control plane's controllers over the durable
// work queue in the database: work is enqueued in the same transaction as the
// change that causes it, claimed with a lease (so a crashed replica's items
// come back), and retried with backoff.
//
// Several replicas share the queue with one owner per item: a controller
// holds a short lease as an owner (LeaseTTL, on the database's clock),
// renewed with every claim and while it processes; a replica that dies
// loses its items to the others once that lease expired, within seconds;
// and settling an item is fenced by ownership, so a replica that stalled
// past its lease rolls back rather than apply an item twice
// (store/workowners.go). It runs the acceptance checks of nodes whose pool
// has them, through a command to the node (accept.go), and deletes expired
// housekeeping rows (prune). Joins adopt the other nodes in their own
// transaction; the controller still adopts those a previous release queued
// (join.WorkAdopt).
package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Config lists the controller's dependencies.
type Config struct {
	DB  *store.DB
	Log *slog.Logger
	Hub *events.Hub
	// Poll is how often the queue is read when nothing wakes it (default 500 ms).
	Poll time.Duration
	// Clock is the time source (command expiry, the poll); nil means the
	// wall clock.
	Clock clock.Clock
	// ID names this controller as a work owner; empty: a fresh random one.
	// It must differ between replicas.
	ID string
	// LeaseTTL is how long this controller owns what it claimed without
	// renewing (default 3 s): how long a dead replica's items wait.
	LeaseTTL time.Duration
	// Notify, when set, is called after a command for a node committed, so
	// the node's session on this process delivers it at once (else the
	// session layer's poll finds it).
	Notify func(nodeID string)
}

// Controller processes the work queue.
type Controller struct {
	cfg  Config
	wake chan struct{}
	// pruned is when prune last ran (Run's goroutine only).
	pruned time.Time
}

// New returns a Controller.
func New(cfg Config) *Controller {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Poll <= 0 {
		cfg.Poll = 500 * time.Millisecond
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.LeaseTTL <= 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.ID == "" {
		cfg.ID = ids.New("ctl", cfg.Clock.Now())
	}
	return &Controller{cfg: cfg, wake: make(chan struct{}, 1)}
}

// DefaultLeaseTTL is how long a controller's claim outlives it.
const DefaultLeaseTTL = 3 * time.Second

// claimLease is when an owned item comes back even to an older replica
// that knows nothing of owners (rolling upgrades).
const claimLease = time.Minute

// ID returns the controller's owner id.
func (c *Controller) ID() string { return c.cfg.ID }

// Wake makes the controller read the queue now.
func (c *Controller) Wake() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// Run processes work until ctx ends.
func (c *Controller) Run(ctx context.Context) {
	defer c.release(ctx)
	// The ticker starts after the first pass, so a test that waits for it
	// to be armed knows the first pass is over.
	var t clock.Ticker
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		for {
			n, err := c.RunOnce(ctx)
			if err != nil && ctx.Err() == nil {
				c.cfg.Log.Error("controller", "err", err)
			}
			// A batch short of claimBatch took every item due when it
			// claimed: claiming again at once would find nothing (one
			// write transaction per pass for nothing, under a join storm
			// one per group commit). Work queued since then woke c.wake,
			// and work that comes due later is found by the ticker.
			if n < claimBatch || err != nil {
				break
			}
		}
		if t == nil {
			t = c.cfg.Clock.NewTicker(c.cfg.Poll)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			c.prune(ctx)
		case <-c.wake:
		}
	}
}

// pruneEvery is how often expired housekeeping rows are deleted.
const pruneEvery = time.Minute

// prune deletes join answers kept past their retention (join.AnswerRetention)
// and renewal proofs past their window, in bounded batches at most once a
// minute, outside any join's or renewal's transaction.
func (c *Controller) prune(ctx context.Context) {
	now := c.cfg.Clock.Now()
	if now.Sub(c.pruned) < pruneEvery {
		return
	}
	c.pruned = now
	err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.DeleteExpiredJoinAnswers(ctx, 1000)
		return err
	})
	if err != nil && ctx.Err() == nil {
		c.cfg.Log.Warn("prune expired join answers", "err", err)
	}
	// A renewal's replay check does not need expired proofs gone
	// (store.UseRenewProof replaces an expired record), so this is only
	// housekeeping: a proof goes renewProofGrace after it expired on this
	// replica's clock, so a replica whose clock is behind by up to that
	// still finds every proof it holds live. Renewals add up to a batch a
	// second or more in a storm, hence batches until the expired ones are
	// gone (bounded per pass).
	before := now.Add(-renewProofGrace)
	for range renewProofBatches {
		var n int
		err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
			var err error
			n, err = tx.DeleteExpiredRenewProofs(ctx, before, pruneBatch)
			return err
		})
		if err != nil {
			if ctx.Err() == nil {
				c.cfg.Log.Warn("prune expired renew proofs", "err", err)
			}
			return
		}
		if n < pruneBatch {
			return
		}
	}
}

// Renewal proofs' prune: rows per transaction, transactions per pass
// (100,000 proofs a minute, more than the renewals a replica can make),
// and how long past its expiry a proof is kept.
const (
	pruneBatch        = 1000
	renewProofBatches = 100
	renewProofGrace   = time.Minute
)

// RunOnce claims and processes one batch; it returns how many items it took.
func (c *Controller) RunOnce(ctx context.Context) (int, error) {
	items, err := c.claim(ctx)
	if err != nil || len(items) == 0 {
		return 0, err
	}
	defer c.keepAlive(ctx)()
	// The whole batch in one transaction (one commit for many adoptions
	// after a rack joined); should any item fail, each goes again alone so
	// one bad item cannot hold back the others.
	if len(items) > 1 {
		err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
			for _, w := range items {
				if err := c.process(ctx, tx, w); err != nil {
					return err
				}
			}
			return nil
		})
		if err == nil {
			return len(items), nil
		}
	}
	for _, w := range items {
		err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error { return c.process(ctx, tx, w) })
		if err != nil {
			backoff := min(time.Duration(1<<min(w.Attempts, 8))*time.Second, 5*time.Minute)
			c.cfg.Log.Warn("work failed", "kind", w.Kind, telemetry.LogNodeID, w.NodeID, "attempt", w.Attempts+1, "err", err)
			if errors.Is(err, store.ErrLeaseLost) {
				// Another replica took it over; it is theirs now.
				continue
			}
			_ = c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error { return tx.FailWork(ctx, w, err.Error(), backoff) })
		}
	}
	return len(items), nil
}

// claimBatch is how many items one pass claims at most.
const claimBatch = 50

// claim renews this controller's lease and claims a batch, in one
// transaction.
func (c *Controller) claim(ctx context.Context) ([]store.WorkItem, error) {
	var items []store.WorkItem
	err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		if err := tx.RenewWorkOwner(ctx, c.cfg.ID, c.cfg.LeaseTTL); err != nil {
			return err
		}
		var err error
		items, err = tx.ClaimWorkAs(ctx, c.cfg.ID, claimBatch, claimLease)
		return err
	})
	return items, err
}

// keepAlive renews the lease every third of LeaseTTL while a batch is
// processed, until the returned func is called.
func (c *Controller) keepAlive(ctx context.Context) (stop func()) {
	var (
		mu      sync.Mutex
		stopped bool
		t       clock.Timer
	)
	every := c.cfg.LeaseTTL / 3
	var renew func()
	renew = func() {
		err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error { return tx.RenewWorkOwner(ctx, c.cfg.ID, c.cfg.LeaseTTL) })
		if err != nil && ctx.Err() == nil {
			c.cfg.Log.Warn("renew work lease", "err", err)
		}
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			t = c.cfg.Clock.AfterFunc(every, renew)
		}
	}
	mu.Lock()
	t = c.cfg.Clock.AfterFunc(every, renew)
	mu.Unlock()
	return func() {
		mu.Lock()
		defer mu.Unlock()
		stopped = true
		t.Stop()
	}
}

// release ends this controller's lease as it stops, so its items move at
// once instead of after LeaseTTL.
func (c *Controller) release(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := c.cfg.DB.WithTx(ctx, func(tx *store.Tx) error { return tx.ReleaseWorkOwner(ctx, c.cfg.ID) }); err != nil {
		c.cfg.Log.Warn("release work lease", "err", err)
	}
}

// process handles one item inside tx and settles it in the queue.
func (c *Controller) process(ctx context.Context, tx *store.Tx, w store.WorkItem) error {
	err := c.handle(ctx, tx, w)
	// A deferred item keeps what its handler wrote and comes back later
	// (acceptance waits for its node and its command).
	var d *deferred
	if errors.As(err, &d) {
		return tx.FailWork(ctx, w, d.reason, d.after)
	}
	if err != nil {
		return err
	}
	return tx.FinishWork(ctx, w)
}

func (c *Controller) handle(ctx context.Context, tx *store.Tx, w store.WorkItem) error {
	switch w.Kind {
	case join.WorkAdopt:
		return c.adopt(ctx, tx, w.NodeID)
	case session.WorkAccept:
		return c.accept(ctx, tx, w)
	default:
		return fmt.Errorf("unknown work kind %q", w.Kind)
	}
}

// adopt moves an adopting node to adopted: a node whose acceptance checks
// passed, one in a pool whose checks were removed meanwhile, and one a
// previous release's join queued (R4.5; joins now adopt in their own
// transaction).
func (c *Controller) adopt(ctx context.Context, tx *store.Tx, nodeID string) error {
	// One statement reads and moves it: a node that is gone or no longer
	// adopting (retired, reclaimed into acceptance) is left alone.
	n, ok, err := tx.AdoptNode(ctx, nodeID)
	if err != nil || !ok {
		return err
	}
	return join.RecordAdopted(ctx, tx, c.cfg.Hub, n)
}

// actor is who the controller's audit rows name.
const actor = "controller"

func nodeResource(id string) string { return "compute-node/" + id }
