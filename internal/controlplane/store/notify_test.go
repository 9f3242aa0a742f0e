package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// R12.3: every statement that makes a command queued (a new
// command, sent ones put back by a session that ended, every sent one put
// back by a new session) notifies the commands channel from inside its
// transaction, so a listener on another replica learns the node id when,
// and only when, the transaction commits. A write that queues nothing, or
// rolls back, notifies nobody: that is shown without waiting for silence,
// by a marker transaction committed after it, whose notification must be
// the next one (PostgreSQL delivers notifications in commit order).
func TestCommandNotifications(t *testing.T) {
	dbs := storetest.PostgresReplicas(t, 2)
	writer, reader := dbs[0], dbs[1]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := reader.ListenCommands(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close(context.Background())
	if l.PID() == 0 {
		t.Error("no backend pid")
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	if ch := writer.CommandsChannel(); ch != reader.CommandsChannel() || !strings.HasPrefix(ch, "bc_commands.bc_test_") {
		t.Errorf("channels %q and %q, want the same, named after the schema", ch, reader.CommandsChannel())
	}
	marker := storetest.Node(t, writer, store.NodeAdopted).ID
	node := storetest.Node(t, writer, store.NodeAdopted).ID
	n := 0
	insert := func(tx *store.Tx, nodeID string) (string, error) {
		n++
		now := time.Now()
		id := ids.New(ids.Command, now)
		return id, tx.InsertCommand(ctx, store.Command{ID: id, NodeID: nodeID, IdentityGeneration: 1, Kind: "node.facts", CreatedAt: now, ExpiresAt: now.Add(time.Hour)})
	}
	sent := func(tx *store.Tx) ([]string, error) {
		var out []string
		for range 2 {
			id, err := insert(tx, node)
			if err != nil {
				return nil, err
			}
			if _, err := tx.MarkCommandSent(ctx, id); err != nil {
				return nil, err
			}
			out = append(out, id)
		}
		return out, nil
	}
	// setup runs in a committed transaction before write, and its
	// notifications are read before write runs.
	tests := []struct {
		name     string
		setup    func(tx *store.Tx) ([]string, error)
		write    func(tx *store.Tx, setup []string) error
		rollback bool
		want     bool // node's id is notified
	}{
		{name: "enqueue", write: func(tx *store.Tx, _ []string) error { _, err := insert(tx, node); return err }, want: true},
		{name: "enqueue rolled back", write: func(tx *store.Tx, _ []string) error { _, err := insert(tx, node); return err }, rollback: true},
		{name: "two enqueues, one notification", write: func(tx *store.Tx, _ []string) error {
			if _, err := insert(tx, node); err != nil {
				return err
			}
			_, err := insert(tx, node)
			return err
		}, want: true},
		{name: "requeue after a session ended", setup: sent, write: func(tx *store.Tx, ids []string) error {
			_, err := tx.RequeueCommands(ctx, node, ids)
			return err
		}, want: true},
		{name: "requeue of nothing sent", write: func(tx *store.Tx, _ []string) error {
			_, err := tx.RequeueCommands(ctx, node, []string{"cmd_unknown"})
			return err
		}},
		{name: "requeue at a new session", setup: sent, write: func(tx *store.Tx, _ []string) error {
			n, err := tx.RequeueSentCommands(ctx, node)
			if err == nil && n != 2 {
				return errors.New("did not requeue both")
			}
			return err
		}, want: true},
		{name: "requeue at a new session, nothing sent", write: func(tx *store.Tx, _ []string) error {
			_, err := tx.RequeueSentCommands(ctx, node)
			return err
		}},
	}
	errRollback := errors.New("roll back")
	// upTo reads notifications until the marker's and returns those before it.
	upTo := func() []string {
		t.Helper()
		if err := writer.WithTx(ctx, func(tx *store.Tx) error { _, err := insert(tx, marker); return err }); err != nil {
			t.Fatal(err)
		}
		var before []string
		for {
			id, err := l.Next(ctx)
			if err != nil {
				t.Fatalf("waiting for notifications: %v", err)
			}
			if id == marker {
				return before
			}
			before = append(before, id)
		}
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var setup []string
			if tc.setup != nil {
				if err := writer.WithTx(ctx, func(tx *store.Tx) error {
					var err error
					setup, err = tc.setup(tx)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				upTo()
			}
			err := writer.WithTx(ctx, func(tx *store.Tx) error {
				if err := tc.write(tx, setup); err != nil {
					return err
				}
				if tc.rollback {
					return errRollback
				}
				return nil
			})
			if err != nil && !(tc.rollback && errors.Is(err, errRollback)) {
				t.Fatal(err)
			}
			got := upTo()
			if want := map[bool]int{true: 1, false: 0}[tc.want]; len(got) != want || want == 1 && got[0] != node {
				t.Errorf("notified %v before the marker, want %d notification(s) of %s", got, want, node)
			}
		})
	}
	// A wait that ends by its context leaves the connection usable.
	short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	defer stop()
	if _, err := l.Next(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Next on a silent channel: %v, want its context's error", err)
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatalf("after a wait ended by its context: %v", err)
	}
	if got := upTo(); len(got) != 0 {
		t.Errorf("notified %v", got)
	}
}

// On SQLite one process holds every session: nothing listens, nothing is
// sent, and writers tell the session service in-process.
func TestCommandNotificationsSQLite(t *testing.T) {
	db := storetest.OpenSQLite(t)
	if _, err := db.ListenCommands(context.Background()); !errors.Is(err, store.ErrNoListen) {
		t.Errorf("ListenCommands on SQLite: %v, want ErrNoListen", err)
	}
	if ch := db.CommandsChannel(); ch != "" {
		t.Errorf("channel %q on SQLite", ch)
	}
}

// A channel name is an identifier: at most 63 bytes, one per schema.
func TestCommandsChannelName(t *testing.T) {
	long := strings.Repeat("s", 63)
	tests := []struct{ schema, want string }{
		{"public", "bc_commands.public"},
		{long, ""},
	}
	for _, tc := range tests {
		got := store.CommandsChannelFor(tc.schema)
		if tc.want != "" && got != tc.want {
			t.Errorf("%q: %q, want %q", tc.schema, got, tc.want)
		}
		if len(got) > 63 {
			t.Errorf("%q: %q is %d bytes", tc.schema, got, len(got))
		}
	}
	if store.CommandsChannelFor(long) == store.CommandsChannelFor(long+"x") {
		t.Error("two long schemas share a channel")
	}
}
