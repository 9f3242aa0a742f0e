package run_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/apitest"
	"github.com/better-compute/better-compute/internal/bcd/run"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/wire"
)

// R12.1: bcd opens a session through the gateway with its node
// certificate; the node becomes connected, and disconnected when bcd stops.
// R4.5: a pool without acceptance checks adopts the node at once.
func TestR12_1SessionConnectsAndDisconnects(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		h := newHarness(t, e)
		pool := h.pool(t, "plain", nil)
		m := h.join(t, h.token(t, pool, false), 1, 4)
		h.waitNode(t, m.nodeID, "adopted (no acceptance checks)", func(n store.Node) bool { return n.State == store.NodeAdopted })
		if n := h.node(t, m.nodeID); n.Connection != store.Disconnected {
			t.Fatalf("before bcd run the node is %s", n.Connection)
		}
		welcomes, stop := h.start(t, m)
		select {
		case id := <-welcomes:
			if id != m.nodeID {
				t.Errorf("Welcome names %s, want %s", id, m.nodeID)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("no Welcome")
		}
		n := h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })
		if n.LastSeen == nil {
			t.Error("last_seen not set on connect")
		}
		stop()
		h.waitNode(t, m.nodeID, "disconnected", func(n store.Node) bool { return n.Connection == store.Disconnected })
		var types []string
		for _, ev := range h.events(t, "node.") {
			if ev.Subject == m.nodeID {
				types = append(types, ev.Type)
			}
		}
		want := "node.joined node.adopted node.connected node.disconnected"
		if got := strings.Join(types, " "); got != want {
			t.Errorf("events %q, want %q", got, want)
		}
	})
}

// R4.5, R12.2: with acceptance checks the node stays adopting and
// disconnected after the join, with nothing queued; its first Hello starts
// acceptance, which runs on the node as a signed command.
func TestR12_2Acceptance(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		h := newHarness(t, e)
		tests := []struct {
			name       string
			policy     *bcv1.AcceptancePolicy
			wantState  string
			wantReason string
		}{
			{name: "checks pass", policy: &bcv1.AcceptancePolicy{MinCpus: 4, MinMemoryBytes: 1 << 30, MinGpus: 1}, wantState: store.NodeAdopted},
			{name: "too few cpus", policy: &bcv1.AcceptancePolicy{MinCpus: 1000000}, wantState: store.NodeFailed,
				wantReason: "minCpus: want at least 1000000, have 4"},
			{name: "too few gpus", policy: &bcv1.AcceptancePolicy{MinGpus: 8}, wantState: store.NodeFailed,
				wantReason: "minGpus: want at least 8, have 1"},
		}
		for i, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				pool := h.pool(t, "acc-"+string(rune('a'+i)), tc.policy)
				m := h.join(t, h.token(t, pool, false), 10+i, 4)
				// The controller runs (poll 100 ms): it must not adopt.
				time.Sleep(300 * time.Millisecond)
				n := h.node(t, m.nodeID)
				if n.State != store.NodeAdopting || n.Connection != store.Disconnected {
					t.Fatalf("after join: %s/%s, want adopting/disconnected", n.State, n.Connection)
				}
				var work []store.WorkItem
				if err := e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
					var err error
					work, err = tx.NodeWork(context.Background(), m.nodeID)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				if len(work) != 0 {
					t.Fatalf("the join queued %v; want nothing before the first Hello", work)
				}
				h.start(t, m)
				n = h.waitNode(t, m.nodeID, tc.wantState, func(n store.Node) bool { return n.State != store.NodeAdopting })
				if n.State != tc.wantState || n.StateReason != tc.wantReason {
					t.Errorf("got %s %q, want %s %q", n.State, n.StateReason, tc.wantState, tc.wantReason)
				}
				wantEvent := "node.adopted"
				if tc.wantState == store.NodeFailed {
					wantEvent = "node.acceptance-failed"
				}
				found := false
				for _, ev := range h.events(t, "node.") {
					if ev.Subject == m.nodeID && ev.Type == wantEvent {
						found = true
						var d map[string]any
						_ = json.Unmarshal(ev.Data, &d)
						if tc.wantReason != "" && d["reason"] != tc.wantReason {
							t.Errorf("%s reason %v", wantEvent, d["reason"])
						}
					}
				}
				if !found {
					t.Errorf("no %s event", wantEvent)
				}
				// The command row finished.
				var cmd store.Command
				if err := e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
					var err error
					cmd, err = tx.LatestCommand(context.Background(), m.nodeID, run.KindAcceptanceCheck)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				if cmd.State != store.CommandDone || cmd.SentAt == nil {
					t.Errorf("command %s: state %s sent %v", cmd.ID, cmd.State, cmd.SentAt)
				}
			})
		}
	})
}

// R12.1: the API refuses sessions of revoked certificates (after a
// reclaim), of retired nodes, and the gateway those without a certificate;
// each refusal is ACCESS_DENIED "Session refused" with a
// security.session.refused event naming the reason.
func TestR12_1SessionRefused(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		h := newHarness(t, e)
		pool := h.pool(t, "p", nil)
		tok := h.token(t, pool, true)

		old := h.join(t, tok, 20, 2)
		h.join(t, tok, 20, 2) // the same machine with a new key: a reclaim
		retired := h.join(t, tok, 21, 2)
		if err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			return tx.SetNodeState(context.Background(), retired.nodeID, store.NodeRetired, "test")
		}); err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name       string
			m          *machine
			wantReason string // "" : refused at the gateway, no event
		}{
			{name: "revoked after reclaim", m: old, wantReason: "cert-generation"},
			{name: "retired node", m: retired, wantReason: "node-retired"},
			{name: "no client certificate"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				var res *agentv1.SessionServerMessage
				var err error
				if tc.m != nil {
					res, err = h.dial(t, tc.m.tlsCert())
				} else {
					res, err = h.dial(t, nil)
				}
				if err == nil {
					t.Fatalf("session opened: %v", res)
				}
				pe, ok := errs.As(wire.FromWire(err))
				if !ok || pe.Code != errs.AccessDenied || pe.Message != "Session refused" {
					t.Fatalf("got %v, want ACCESS_DENIED Session refused", err)
				}
				if tc.wantReason == "" {
					return
				}
				found := false
				for _, ev := range h.events(t, "security.session.refused") {
					var d map[string]any
					_ = json.Unmarshal(ev.Data, &d)
					if d["reason"] == tc.wantReason && d["nodeId"] == tc.m.nodeID {
						found = true
					}
				}
				if !found {
					t.Errorf("no security.session.refused event with reason %s", tc.wantReason)
				}
				if n := h.node(t, tc.m.nodeID); n.Connection != store.Disconnected {
					t.Errorf("refused node is %s", n.Connection)
				}
			})
		}
	})
}

// R12.3: bcd runs a command only when it verifies under the command-signing
// bundle, names this node and has not expired.
func TestR12_3CommandVerification(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		h := newHarness(t, e)
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 30, 2)
		other, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		body := func(node string, expires time.Time) []byte {
			b, _ := proto.Marshal(&agentv1.CommandBody{CommandId: "cmd_1", NodeId: node, Kind: run.KindNodeFacts, Args: []byte("{}"),
				IssuedAtUnixMs: now.UnixMilli(), ExpiresAtUnixMs: expires.UnixMilli()})
			return b
		}
		signWith := func(k *ecdsa.PrivateKey, b []byte) *agentv1.SignedCommand {
			sig, err := pki.SignPurpose(k, pki.PurposeCommand, b)
			if err != nil {
				t.Fatal(err)
			}
			return &agentv1.SignedCommand{Body: b, Sig: sig}
		}
		cmdKey, ok := e.Bundle.CommandSigningKey.(*ecdsa.PrivateKey)
		if !ok {
			t.Fatal("command-signing key is not ECDSA")
		}
		good := body(m.nodeID, now.Add(time.Minute))
		wrongPurpose, _ := pki.SignPurpose(cmdKey, pki.PurposeRenewPoP, good)
		tests := []struct {
			name string
			sc   *agentv1.SignedCommand
			want string
		}{
			{"signed by the command-signing key", signWith(cmdKey, good), ""},
			{"re-signed with another key", signWith(other, good), run.RefusedSignature},
			{"signed for another purpose", &agentv1.SignedCommand{Body: good, Sig: wrongPurpose}, run.RefusedSignature},
			{"body altered after signing", &agentv1.SignedCommand{Body: body("node_other", now.Add(time.Minute)), Sig: signWith(cmdKey, good).Sig}, run.RefusedSignature},
			{"another node", signWith(cmdKey, body("node_01other", now.Add(time.Minute))), run.RefusedNode},
			{"expired", signWith(cmdKey, body(m.nodeID, now.Add(-time.Second))), run.RefusedExpired},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				_, got := run.Verify(m.id, tc.sc, now)
				if got != tc.want {
					t.Errorf("Verify = %q, want %q", got, tc.want)
				}
			})
		}
	})
}
