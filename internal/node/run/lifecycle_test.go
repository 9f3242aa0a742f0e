package run_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R12.1: a session ends within a second of a
// retirement, reclaim, revocation or a newer session, made by another
// replica (straight in the database here, so no EndNode reaches this
// one): one check interval of the API's clock (500 ms) ends it, with no
// heartbeat and no command poll. A retired node's bcd stops.
func TestR12_1SessionEndsWithinASecond(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		ctx := context.Background()
		tok := h.token(t, h.pool(t, "p", nil), true)
		tests := []struct {
			name       string
			change     func(t *testing.T, m *machine)
			wantReason string // node.disconnected; "" when a newer session holds the node
			retired    bool
		}{
			{name: "retired elsewhere", wantReason: session.EndRetired, retired: true, change: func(t *testing.T, m *machine) {
				h.tx(t, func(tx *store.Tx) error {
					if err := tx.SetNodeState(ctx, m.nodeID, store.NodeRetired, "elsewhere"); err != nil {
						return err
					}
					_, err := tx.RevokeAllNodeCerts(ctx, m.nodeID, "retired")
					return err
				})
			}},
			{name: "reclaimed", wantReason: session.EndReclaimed, change: func(t *testing.T, m *machine) {
				h.join(t, tok, 101, 2) // the same machine, a new key
			}},
			{name: "certificate revoked elsewhere", wantReason: session.EndRevoked, change: func(t *testing.T, m *machine) {
				h.tx(t, func(tx *store.Tx) error {
					_, err := tx.RevokeNodeCerts(ctx, m.nodeID, 2, "compromised")
					return err
				})
			}},
			{name: "a newer session on another replica", change: func(t *testing.T, m *machine) {
				h.tx(t, func(tx *store.Tx) error {
					_, err := tx.ConnectNode(ctx, m.nodeID, "sess_on_another_replica")
					return err
				})
			}},
		}
		for i, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				m := h.join(t, tok, 100+i, 2)
				p := h.start(t, m)
				p.welcome(t)
				sessions := h.e.Server.Sessions()
				if !sessions.Connected(m.nodeID) {
					t.Fatal("no session after Welcome")
				}
				// The poll ticker is armed once a session is held.
				if err := h.clock.WaitArmed(ctxT(t), 1); err != nil {
					t.Fatal(err)
				}
				tc.change(t, m)
				h.clock.Advance(session.DefaultCheck) // one check, 500 ms
				eventually(t, "the session to end", func() bool { return !sessions.Connected(m.nodeID) })
				if tc.wantReason != "" && !h.disconnectedBecause(t, m.nodeID, tc.wantReason) {
					t.Errorf("no node.disconnected event with reason %s", tc.wantReason)
				}
				if tc.retired {
					if err := p.exited(t); !errors.Is(err, run.ErrRetired) {
						t.Fatalf("bcd run: %v, want ErrRetired", err)
					}
				}
			})
		}
	})
}

// R19.3: a gateway that restarts ends the sessions it relays (the daemons
// reconnect); bcd waits its first reconnect (drawn from [0, 10 s): 5 s
// with the middle jitter) on its clock and opens its session again
// through the restarted gateway, which relays commands as before.
func TestGatewayRestartR19_3(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		gw := h.restartableGateway(t)
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 190, 3)
		p := h.startVia(t, m, gw.url())
		p.welcome(t)
		sessions := h.e.Server.Sessions()
		eventually(t, "the API to hold the session", func() bool { return sessions.Connected(m.nodeID) })

		gw.shutdown(t)
		eventually(t, "the session to end with the gateway", func() bool { return !sessions.Connected(m.nodeID) })
		if !h.disconnectedBecause(t, m.nodeID, "closed") {
			t.Error("no node.disconnected event with reason closed")
		}
		first := run.FirstReconnectSpread / 2
		p.waitDeadline(t, "bcd's first reconnect", p.clock.Now().Add(first))

		gw.start(t)
		p.clock.Advance(first)
		if id := p.welcome(t); id != m.nodeID {
			t.Fatalf("Welcome names %s", id)
		}
		eventually(t, "the API to hold the session again", func() bool { return sessions.Connected(m.nodeID) })
		if c := h.waitCommand(t, h.enqueue(t, m.nodeID)); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":3`) {
			t.Errorf("command through the restarted gateway: %s %q %s", c.State, c.Error, c.Result)
		}
	})
}

// tx runs fn in a write transaction.
func (h *harness) tx(t testing.TB, fn func(tx *store.Tx) error) {
	t.Helper()
	if err := h.e.DB.WithTx(context.Background(), fn); err != nil {
		t.Fatal(err)
	}
}

// R12.1: heartbeats, idleness and the reconnect backoff run on clocks:
// bcd's heartbeat (on its clock) reaches the API, which records it; a
// session silent for three heartbeats (on the API's clock) is ended; bcd
// then waits its first reconnect (drawn from [0, 10 s): 5 s with the middle
// jitter) on its clock and reconnects.
func TestR12_1HeartbeatIdleAndBackoff(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 110, 2)
		p := h.start(t, m)
		p.welcome(t)
		connected := h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })

		// A heartbeat is written at most every TouchEvery (30 s). bcd arms
		// its heartbeat and identity-check tickers after Welcome.
		h.clock.Advance(session.DefaultTouchEvery + time.Second)
		if err := p.clock.WaitArmed(ctxT(t), 2); err != nil {
			t.Fatal(err)
		}
		h.dbClockPast(t, *connected.LastSeen) // so the heartbeat's write shows
		p.clock.Advance(session.DefaultHeartbeat)
		h.waitNode(t, m.nodeID, "the heartbeat recorded", func(n store.Node) bool { return n.LastSeen != nil && n.LastSeen.After(*connected.LastSeen) })
		if !h.e.Server.Sessions().Connected(m.nodeID) {
			t.Fatal("the session ended while heartbeats flowed")
		}

		// Silence for three heartbeats and a check.
		h.clock.Advance(3*session.DefaultHeartbeat + session.DefaultCheck)
		eventually(t, "the idle session to end", func() bool { return !h.e.Server.Sessions().Connected(m.nodeID) })
		if !h.disconnectedBecause(t, m.nodeID, "idle") {
			t.Error("no node.disconnected event with reason idle")
		}

		// bcd's first reconnect: drawn from [0, FirstReconnectSpread) (the
		// harness's jitter is the middle), on its clock.
		first := run.FirstReconnectSpread / 2
		want := p.clock.Now().Add(first)
		eventually(t, "bcd's backoff timer", func() bool {
			for _, d := range p.clock.Deadlines() {
				if d.Equal(want) {
					return true
				}
			}
			return false
		})
		p.clock.Advance(first)
		if id := p.welcome(t); id != m.nodeID {
			t.Errorf("Welcome names %s", id)
		}
	})
}

// R12.3: a command queued while its node has no session waits for the
// next one; a command sent into a session that ended without an answer
// goes back to the queue and is delivered by the next session.
func TestR12_3CommandWaitsForTheNextSession(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		t.Run("queued while away", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "away", nil), false), 120, 3)
			id := h.enqueue(t, m.nodeID)
			if c := h.command(t, id); c.State != store.CommandQueued {
				t.Fatalf("command %s without a session, want queued", c.State)
			}
			h.start(t, m)
			if c := h.waitCommand(t, id); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":3`) {
				t.Errorf("command %s %q %s", c.State, c.Error, c.Result)
			}
		})
		t.Run("sent into a session that ended", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "lost", nil), false), 121, 3)
			evil := h.newEvilGateway(t)
			evil.set(func(g *evilGateway) { g.drop = true }) // the command never reaches bcd
			p := h.startVia(t, m, evil.url)
			p.welcome(t)
			id := h.enqueue(t, m.nodeID)
			eventually(t, "the command sent", func() bool { return h.command(t, id).State == store.CommandSent })
			p.stop(t)
			eventually(t, "the command back in the queue", func() bool {
				c := h.command(t, id)
				return c.State == store.CommandQueued && c.SentAt == nil
			})
			evil.set(func(g *evilGateway) { g.drop = false })
			h.startVia(t, m, evil.url)
			if c := h.waitCommand(t, id); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":3`) {
				t.Errorf("command %s %q %s", c.State, c.Error, c.Result)
			}
		})
		t.Run("answer lost: at most once", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "answer-lost", nil), false), 122, 3)
			evil := h.newEvilGateway(t)
			evil.set(func(g *evilGateway) {
				g.tamper = func(int, *agentv1.CommandResult) *agentv1.CommandResult { return nil } // the answer never arrives
			})
			p := h.startVia(t, m, evil.url)
			p.welcome(t)
			id := h.enqueue(t, m.nodeID)
			waitResults(t, evil, 0, id, 1) // bcd ran it and answered
			p.stop(t)
			eventually(t, "the command back in the queue", func() bool { return h.command(t, id).State == store.CommandQueued })
			evil.set(func(g *evilGateway) { g.tamper = nil })
			h.startVia(t, m, evil.url) // bcd restarted
			if c := h.waitCommand(t, id); c.State != store.CommandFailed || c.Error != run.RefusedReplayed {
				t.Errorf("command %s %q, want failed %q: it ran once already", c.State, c.Error, run.RefusedReplayed)
			}
		})
	})
}

// A replica shutting down ends its sessions (UNAVAILABLE: reconnect, to
// another replica), refuses new ones, and returns once every session
// handler wrote its disconnect, so the database can close behind it.
func TestSessionServiceClose(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 140, 2)
		p := h.start(t, m)
		p.welcome(t)
		if err := h.e.Server.Sessions().Close(ctxT(t)); err != nil {
			t.Fatalf("Close: %v", err)
		}
		// Close returned after the disconnect was written.
		if n := h.node(t, m.nodeID); n.Connection != store.Disconnected {
			t.Errorf("after Close the node is %s", n.Connection)
		}
		if !h.disconnectedBecause(t, m.nodeID, "shutdown") {
			t.Error("no node.disconnected event with reason shutdown")
		}
		_, err := h.dial(t, m, m.id.Signer)
		if pe, ok := errs.As(wire.FromWire(err)); !ok || pe.Code != errs.Unavailable {
			t.Errorf("a session after Close: %v, want UNAVAILABLE", err)
		}
	})
}

// R19.3: a renewed certificate is used for the next session at once: the
// renewer tells the session, which reconnects with the new identity
// without waiting for its periodic identity check (bcd's clock never
// moves here, so only the signal can end the first session).
func TestRenewedIdentityUsedAtOnceR19_3(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 130, 2)
		renewed := make(chan struct{}, 1)
		p := h.startWith(t, m, "https://"+h.gwAddr, renewed)
		p.welcome(t)
		cfg := *m.cfg
		cfg.GatewayURL = "https://" + h.gwAddr
		r, err := renew.New(renew.Config{BCD: &cfg, Store: m.store, Clock: p.clock, Log: quiet()})
		if err != nil {
			t.Fatal(err)
		}
		next, err := r.RenewOnce(ctxT(t))
		if err != nil {
			t.Fatalf("renew: %v", err)
		}
		renewed <- struct{}{}
		if id := p.welcome(t); id != m.nodeID {
			t.Fatalf("the session after the renewal welcomed %s", id)
		}
		eventually(t, "a node.connected event on the renewed certificate", func() bool {
			for _, ev := range h.events(t, "node.connected") {
				var d map[string]any
				_ = json.Unmarshal(ev.Data, &d)
				if ev.Subject == m.nodeID && d["certSerial"] == next.Serial {
					return true
				}
			}
			return false
		})
	})
}
