package run_test

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/commands"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// commands across API replicas. The harness is replica A (its
// operator API, commands service, controller, and gateway); replicaB is a
// second api.Server on its own store handle of the same PostgreSQL schema,
// with its own agent listener, a real gateway in front of it, and its
// command Listener, as `serve` runs it. A's Notify reaches only A's
// session service.

// replicaB is the second replica.
type replicaB struct {
	srv *api.Server
	db  *store.DB
	// clock is B's API clock. No test moves it, so B's session service
	// never polls, checks or times out: what B delivers, it delivered
	// because it was told.
	clock *clock.Fake
	// lclock is the listener's clock, moved only through its backoff.
	lclock *clock.Fake
	ln     *session.Listener
	gwURL  string
}

// replicas runs fn on every stack with replica A (the harness) and
// replica B on one fresh PostgreSQL schema; it skips without PostgreSQL.
func replicas(t *testing.T, fn func(t *testing.T, h *harness, b *replicaB)) {
	onStacks(t, stacks, func(t *testing.T, st stack) {
		dbs := storetest.PostgresReplicas(t, 2)
		c := clock.NewFake(time.Now())
		h := newHarness(t, apitest.Start(t, dbs[0], apitest.Options{Clock: c}), c, st)
		fn(t, h, startReplicaB(t, h, dbs[1]))
	})
}

func startReplicaB(t *testing.T, h *harness, db *store.DB) *replicaB {
	t.Helper()
	b := &replicaB{db: db, clock: clock.NewFake(time.Now()), lclock: clock.NewFake(time.Now())}
	srv, err := api.New(api.Config{DB: db, Bundle: h.e.Bundle, Clock: b.clock, Log: quiet(), SessionPoll: 24 * time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	b.srv = srv
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	// Registered before B's agent listener, gateway and daemons, so it
	// runs after their cleanups and before the store closes.
	t.Cleanup(func() {
		cancel()
		<-done
		sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
		defer c()
		if err := srv.Sessions().Close(sctx); err != nil {
			t.Errorf("replica B's session handlers still running: %v", err)
		}
	})
	// As server.Run wires it.
	b.ln = session.NewListener(session.ListenerConfig{DB: db, Clock: b.lclock, Log: quiet(), Notify: srv.Sessions().Notify})
	go func() { defer close(done); b.ln.Run(ctx) }()
	addr, _ := h.startGateway(t, h.startAgent(t, srv))
	b.gwURL = "https://" + addr
	eventually(t, "replica B's listener to listen", func() bool { return b.ln.Status().Listening })
	return b
}

// connect starts bcd for m through replica B's gateway and waits until B
// holds its session and is done with what the session delivers when it
// starts: a command queued before it connected (the barrier) answered.
// After that, B's session delivers a command only when it is told.
func (b *replicaB) connect(t *testing.T, h *harness, m *machine, cpus string) *bcdProc {
	t.Helper()
	barrier := h.enqueue(t, m.nodeID)
	p := h.startVia(t, m, b.gwURL)
	p.welcome(t)
	eventually(t, "replica B to hold the session", func() bool { return b.srv.Sessions().Connected(m.nodeID) })
	wantFacts(t, h, barrier, cpus)
	return p
}

// wantFacts checks that command id finished with node.facts' answer.
func wantFacts(t *testing.T, h *harness, id string, cpus string) {
	t.Helper()
	if c := h.waitCommand(t, id); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":`+cpus) {
		t.Errorf("command %s %q %s, want done with %s cpus", c.State, c.Error, c.Result, cpus)
	}
}

// R12.3: a command enqueued through replica A reaches the
// node's session on replica B at once, by the PostgreSQL notification
// alone: B's poll is a day and B's clock never moves. After B's listening
// connection is killed, a command enqueued while nobody listened (its
// notification is lost) arrives by the scan B runs when it listens again,
// and the next one by a notification on the new connection.
func TestR12_3CommandReachesSessionOnAnotherReplica(t *testing.T) {
	replicas(t, func(t *testing.T, h *harness, b *replicaB) {
		t.Run("notification", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "notified", nil), false), 200, 3)
			b.connect(t, h, m, "3")
			id := h.enqueue(t, m.nodeID) // A's operator API and commands service
			wantFacts(t, h, id, "3")
			if h.e.Server.Sessions().Connected(m.nodeID) {
				t.Error("replica A holds a session of the node too")
			}
		})
		t.Run("after the listener reconnects", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "reconnected", nil), false), 201, 5)
			b.connect(t, h, m, "5")
			before := b.ln.Status()
			if !before.Listening || before.BackendPID == 0 {
				t.Fatalf("listener %+v", before)
			}
			admin, err := sql.Open("pgx", os.Getenv(storetest.PostgresEnv))
			if err != nil {
				t.Fatal(err)
			}
			defer admin.Close()
			var killed bool
			if err := admin.QueryRow("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1 AND query LIKE 'LISTEN%'",
				int64(before.BackendPID)).Scan(&killed); err != nil || !killed {
				t.Fatalf("terminate the listener's backend %d: %v %v", before.BackendPID, killed, err)
			}
			eventually(t, "the listener to notice", func() bool { return !b.ln.Status().Listening })
			lost := h.enqueue(t, m.nodeID) // nobody listens: its notification is lost
			if err := b.lclock.WaitArmed(ctxT(t), 1); err != nil {
				t.Fatal(err)
			}
			b.lclock.Advance(session.DefaultMinBackoff) // the first backoff after a lost connection
			eventually(t, "the listener back", func() bool {
				s := b.ln.Status()
				return s.Listening && s.Connects == before.Connects+1 && s.BackendPID != before.BackendPID
			})
			wantFacts(t, h, lost, "5")
			wantFacts(t, h, h.enqueue(t, m.nodeID), "5")
		})
	})
}

// R12.3: on SQLite (one process) nothing listens: the
// listener returns at once, and a command enqueued through the operator
// API reaches the session by the in-process Notify, the API's clock never
// moving.
func TestR12_3InProcessNotifyOnSQLite(t *testing.T) {
	db := storetest.OpenSQLite(t)
	c := clock.NewFake(time.Now())
	h := newHarness(t, apitest.Start(t, db, apitest.Options{Clock: c}), c, stackNetHTTP)
	l := session.NewListener(session.ListenerConfig{DB: db, Notify: h.e.Server.Sessions().Notify})
	done := make(chan struct{})
	go func() { l.Run(ctxT(t)); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the listener runs on SQLite")
	}
	if s := l.Status(); s.Listening || s.Connects != 0 {
		t.Errorf("listener %+v on SQLite", s)
	}
	m := h.join(t, h.token(t, h.pool(t, "sqlite", nil), false), 202, 2)
	barrier := h.enqueue(t, m.nodeID) // delivered when the session starts
	h.start(t, m).welcome(t)
	wantFacts(t, h, barrier, "2")
	wantFacts(t, h, h.enqueue(t, m.nodeID), "2")
}

// R12.3: replica A sends a command into a node's session and
// dies before its session could put the command back or mark the node
// disconnected, so the command stays sent. When the node connects to
// replica B, B puts it back in the queue and delivers it: a command that
// never reached bcd runs there; one bcd already ran (its answer was lost
// with A) is refused by bcd ("replayed": bcd's id memory on disk), so it
// ran once, and ends failed. A node that never comes back leaves the
// command sent until the expiry sweep ends it. Either way it ends.
//
// A's death is simulated in the store: A's session does end in-process
// (the daemon stops), so once its finish ran the test puts back what
// finish changed (the command sent again, the node connected by A's
// session), which is what a process that died before finish leaves.
func TestR12_3SentCommandOfDeadReplica(t *testing.T) {
	replicas(t, func(t *testing.T, h *harness, b *replicaB) {
		dropCommands := func(g *evilGateway) { g.drop = true }
		dropAnswers := func(g *evilGateway) {
			g.tamper = func(int, *agentv1.CommandResult) *agentv1.CommandResult { return nil }
		}
		tests := []struct {
			name string
			// lose is how the relay in front of A loses the command or
			// bcd's answer.
			lose      func(g *evilGateway)
			ran       bool // bcd ran it on A
			reconnect bool // the node connects to B
			state     string
			err       string
		}{
			{"never reached bcd: runs on B", dropCommands, false, true, store.CommandDone, ""},
			{"ran, answer lost: bcd refuses it on B", dropAnswers, true, true, store.CommandFailed, run.RefusedReplayed},
			{"node never comes back: expires", dropCommands, false, false, store.CommandExpired, "expired without an answer"},
		}
		for i, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				m := h.join(t, h.token(t, h.pool(t, "dead-"+string(rune('a'+i)), nil), false), 210+i, 4)
				evil := h.newEvilGateway(t) // in front of replica A
				evil.set(tc.lose)
				p := h.startVia(t, m, evil.url)
				p.welcome(t)
				eventually(t, "replica A to hold the session", func() bool { return h.e.Server.Sessions().Connected(m.nodeID) })
				id := h.enqueue(t, m.nodeID)
				eventually(t, "the command sent", func() bool { return h.command(t, id).State == store.CommandSent })
				if tc.ran {
					waitResults(t, evil, 0, id, 1) // bcd ran it; the relay dropped the answer
				}

				// Replica A dies.
				p.stop(t)
				eventually(t, "A's session to finish", func() bool {
					return h.node(t, m.nodeID).Connection == store.Disconnected && h.command(t, id).State == store.CommandQueued
				})
				h.tx(t, func(tx *store.Tx) error {
					if ok, err := tx.MarkCommandSent(context.Background(), id); err != nil || !ok {
						t.Fatalf("mark sent again: %v %v", ok, err)
					}
					// Connected by A's session (B needs no more than that it
					// is not its own).
					_, err := tx.ConnectNode(context.Background(), m.nodeID, "sess_dead_replica_a")
					return err
				})

				if tc.reconnect {
					p := h.startVia(t, m, b.gwURL)
					p.welcome(t)
				} else {
					// Nobody will answer: the sweep expires it once its
					// expiry passed by the database's clock.
					if err := b.db.SetClockOffset(ctxT(t), commands.DefaultTTL+time.Minute); err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _ = b.db.SetClockOffset(context.Background(), 0) })
					if n, err := b.srv.Commands().Expire(ctxT(t)); err != nil || n != 1 {
						t.Fatalf("expired %d (%v), want 1", n, err)
					}
				}
				c := h.waitCommand(t, id)
				if c.State != tc.state || c.Error != tc.err {
					t.Errorf("command %s %q, want %s %q", c.State, c.Error, tc.state, tc.err)
				}
				if tc.state == store.CommandDone && !strings.Contains(string(c.Result), `"cpus":4`) {
					t.Errorf("result %s", c.Result)
				}
				if tc.ran {
					// bcd answered the second delivery without running it.
					_, results := evil.snapshot()
					if len(results) != 1 || !results[0].GetOk() {
						t.Errorf("through A bcd answered %v, want one successful run", results)
					}
				}
				if tc.reconnect {
					eventually(t, "node.connected on B saying it put the command back", func() bool {
						for _, a := range h.audit(t, m.nodeID) {
							if a.Action == "node.connected" && strings.Contains(string(a.Data), `"commandsRequeued":1`) {
								return true
							}
						}
						return false
					})
				}
			})
		}
	})
}
