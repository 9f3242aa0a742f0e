package commands_test

import (
	"context"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/commands"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// R12.3, R14.2: the expiry sweep runs on the injected clock (the
// database's clock decides what expired): one ExpireEvery expires a
// command past its expiry, with a command.expired event and audit row.
func TestExpirySweepRunsOnTheClock(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		now := time.Now()
		n := storetest.Node(t, db, store.NodeAdopted)
		tenant, cmdID := n.TenantID, ids.New(ids.Command, now)
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			return tx.InsertCommand(ctx, store.Command{ID: cmdID, NodeID: n.ID, IdentityGeneration: 1, Kind: "node.facts",
				CreatedAt: now.Add(-time.Hour), ExpiresAt: now.Add(-time.Minute)})
		})
		if err != nil {
			t.Fatal(err)
		}
		c := clock.NewFake(now)
		svc := commands.New(commands.Config{DB: db, Clock: c})
		done := make(chan struct{})
		go func() { svc.RunExpiry(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		if err := c.WaitArmed(ctx, 1); err != nil {
			t.Fatal(err)
		}
		c.Advance(commands.ExpireEvery)
		var cmd store.Command
		poll.UntilDetail(t, 10*time.Second, func() string { return "the command expired after one sweep interval (state " + cmd.State + ")" }, func() bool {
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				cmd, err = tx.GetCommand(ctx, cmdID)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return cmd.State == store.CommandExpired
		})
		if cmd.Error != "expired before delivery" {
			t.Errorf("expired with %q", cmd.Error)
		}
		var audit []store.AuditEntry
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			audit, err = tx.ListAudit(ctx, tenant, 0, 10)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if len(audit) != 1 || audit[0].Action != "command.expired" || audit[0].Actor != "system" {
			t.Errorf("audit %+v, want one command.expired by system", audit)
		}
	})
}

// R12.3: every command ends. The sweep expires a command nobody
// delivered (queued) and one delivered that nobody answered (sent: its
// session's replica died, and its node did not come back before the
// expiry), each saying which; a command not yet due, or finished, is left
// alone.
func TestExpireEndsQueuedAndSent(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		now := time.Now()
		n := storetest.Node(t, db, store.NodeAdopted)
		tests := []struct {
			name      string
			expiresIn time.Duration
			sent      bool
			done      bool
			state     string
			err       string
		}{
			{"queued, due", -time.Minute, false, false, store.CommandExpired, "expired before delivery"},
			{"sent, due", -time.Minute, true, false, store.CommandExpired, "expired without an answer"},
			{"sent, not due", time.Hour, true, false, store.CommandSent, ""},
			{"answered, due", -time.Minute, true, true, store.CommandDone, ""},
		}
		cmdIDs := make([]string, len(tests))
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i, tc := range tests {
				cmdIDs[i] = ids.New(ids.Command, now)
				if err := tx.InsertCommand(ctx, store.Command{ID: cmdIDs[i], NodeID: n.ID, IdentityGeneration: 1, Kind: "node.facts",
					CreatedAt: now.Add(-time.Hour), ExpiresAt: now.Add(tc.expiresIn)}); err != nil {
					return err
				}
				if tc.sent {
					if _, err := tx.MarkCommandSent(ctx, cmdIDs[i]); err != nil {
						return err
					}
				}
				if tc.done {
					if _, err := tx.FinishCommand(ctx, cmdIDs[i], store.CommandDone, []byte(`{}`), ""); err != nil {
						return err
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		svc := commands.New(commands.Config{DB: db, Clock: clock.NewFake(now)})
		if got, err := svc.Expire(ctx); err != nil || got != 2 {
			t.Fatalf("Expire = %d, %v; want 2", got, err)
		}
		for i, tc := range tests {
			var c store.Command
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				c, err = tx.GetCommand(ctx, cmdIDs[i])
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if c.State != tc.state || c.Error != tc.err {
				t.Errorf("%s: %s %q, want %s %q", tc.name, c.State, c.Error, tc.state, tc.err)
			}
		}
	})
}
