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
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R12.1: bcd opens a session through the gateway with its node
// certificate and its key's proof; the node becomes connected, and
// disconnected when bcd stops. R4.5: a pool without acceptance checks
// adopts the node at once. R14.2: connect and disconnect are audited (who,
// what, when, on what).
func TestR12_1SessionConnectsAndDisconnects(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		pool := h.pool(t, "plain", nil)
		m := h.join(t, h.token(t, pool, false), 1, 4)
		if m.id.IdentityGeneration != 1 {
			t.Errorf("the join answer names generation %d, want 1", m.id.IdentityGeneration)
		}
		h.waitNode(t, m.nodeID, "adopted (no acceptance checks)", func(n store.Node) bool { return n.State == store.NodeAdopted })
		if n := h.node(t, m.nodeID); n.Connection != store.Disconnected {
			t.Fatalf("before bcd run the node is %s", n.Connection)
		}
		p := h.start(t, m)
		if id := p.welcome(t); id != m.nodeID {
			t.Errorf("Welcome names %s, want %s", id, m.nodeID)
		}
		n := h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })
		if n.LastSeen == nil {
			t.Error("last_seen not set on connect")
		}
		p.stop(t)
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
		var audit []string
		for _, a := range h.audit(t, m.nodeID) {
			var d map[string]any
			_ = json.Unmarshal(a.Data, &d)
			if strings.HasPrefix(a.Action, "node.connected") || strings.HasPrefix(a.Action, "node.disconnected") {
				audit = append(audit, a.Action+" by "+a.Actor+" reason="+str(d["reason"])+" serial="+str(d["certSerial"]))
				if a.CreatedAt.IsZero() {
					t.Errorf("%s audit row has no time", a.Action)
				}
			}
		}
		wantAudit := []string{"node.connected by node:" + m.nodeID + " reason= serial=" + m.id.Serial,
			"node.disconnected by node:" + m.nodeID + " reason=closed serial=" + m.id.Serial}
		if strings.Join(audit, "\n") != strings.Join(wantAudit, "\n") {
			t.Errorf("R14.2 audit rows:\n%s\nwant:\n%s", strings.Join(audit, "\n"), strings.Join(wantAudit, "\n"))
		}
	})
}

func str(v any) string {
	if v == nil {
		return ""
	}
	s, _ := v.(string)
	return s
}

// R4.5, R12.2: with acceptance checks the node stays adopting and
// disconnected after the join, with nothing queued; its first Hello starts
// acceptance, which runs on the node as a signed command.
func TestR12_2Acceptance(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
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
				// The join committed the node and any work it queued in one
				// transaction, and a work item lives until the node it
				// adopts is adopted: reading the queue first, then the node,
				// shows what the join did, with no wait.
				var work []store.WorkItem
				if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
					var err error
					work, err = tx.NodeWork(context.Background(), m.nodeID)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				if len(work) != 0 {
					t.Fatalf("the join queued %v; want nothing before the first Hello", work)
				}
				if n := h.node(t, m.nodeID); n.State != store.NodeAdopting || n.Connection != store.Disconnected {
					t.Fatalf("after join: %s/%s, want adopting/disconnected", n.State, n.Connection)
				}
				h.start(t, m)
				n := h.waitNode(t, m.nodeID, tc.wantState, func(n store.Node) bool { return n.State != store.NodeAdopting })
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
				// The command row finished, answered by the node (signed).
				var cmd store.Command
				if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
					var err error
					cmd, err = tx.LatestCommand(context.Background(), m.nodeID, wire.KindAcceptanceCheck)
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
// reclaim), of retired nodes, of a certificate whose key the other end
// cannot prove, and the gateway those without a certificate; each refusal
// is ACCESS_DENIED "Session refused" with a security.session.refused event
// naming the reason. A retired node that proves its key is told it was
// retired instead (so bcd stops), and the refusal is recorded all the same.
func TestR12_1SessionRefused(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		pool := h.pool(t, "p", nil)
		tok := h.token(t, pool, true)

		old := h.join(t, tok, 20, 2)
		h.join(t, tok, 20, 2) // the same machine with a new key: a reclaim
		retired := h.join(t, tok, 21, 2)
		other := h.join(t, tok, 22, 2)
		if err := h.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			return tx.SetNodeState(context.Background(), retired.nodeID, store.NodeRetired, "test")
		}); err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name       string
			m          *machine
			proveWith  *identity.Identity // whose key signs the proof; nil: none
			wantCode   errs.Code
			wantMsg    string
			wantReason string // "" : refused at the gateway, no event
		}{
			{name: "revoked after reclaim", m: old, proveWith: old.id, wantCode: errs.AccessDenied, wantMsg: "Session refused", wantReason: "cert-generation"},
			{name: "retired node, no proof", m: retired, wantCode: errs.AccessDenied, wantMsg: "Session refused", wantReason: "node-retired"},
			{name: "retired node, proof by another key", m: retired, proveWith: other.id, wantCode: errs.AccessDenied, wantMsg: "Session refused", wantReason: "node-retired"},
			{name: "retired node proving its key", m: retired, proveWith: retired.id, wantCode: errs.InvalidState, wantMsg: wire.NodeRetiredMessage, wantReason: "node-retired"},
			{name: "proof by another node's key", m: other, proveWith: old.id, wantCode: errs.AccessDenied, wantMsg: "Session refused", wantReason: "session-proof"},
			{name: "no proof", m: other, wantCode: errs.AccessDenied, wantMsg: "Session refused", wantReason: "session-proof"},
			{name: "no client certificate", wantCode: errs.AccessDenied, wantMsg: "Session refused"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				before := 0
				if tc.m != nil {
					before = h.refusals(t, tc.m.nodeID, tc.wantReason)
				}
				var res *agentv1.SessionServerMessage
				var err error
				if tc.proveWith != nil {
					res, err = h.dial(t, tc.m, tc.proveWith.Signer)
				} else {
					res, err = h.dial(t, tc.m, nil)
				}
				if err == nil {
					t.Fatalf("session opened: %v", res)
				}
				pe, ok := errs.As(wire.FromWire(err))
				if !ok || pe.Code != tc.wantCode || pe.Message != tc.wantMsg {
					t.Fatalf("got %v, want %s %s", err, tc.wantCode, tc.wantMsg)
				}
				if tc.wantReason == "" {
					return
				}
				if n := h.refusals(t, tc.m.nodeID, tc.wantReason); n != before+1 {
					t.Errorf("%d new security.session.refused events with reason %s, want 1", n-before, tc.wantReason)
				}
				if n := h.node(t, tc.m.nodeID); n.Connection != store.Disconnected {
					t.Errorf("refused node is %s", n.Connection)
				}
			})
		}
	})
}

// R12.3: bcd runs a command only when it verifies under the command-signing
// bundle, names this node and this identity generation, and has not
// expired. An identity saved before bcd kept its generation (0) takes
// only commands issued after it joined.
func TestR12_3CommandVerification(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 30, 2)
		other, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		type bodyOpt func(*agentv1.CommandBody)
		body := func(opts ...bodyOpt) []byte {
			b := &agentv1.CommandBody{CommandId: "cmd_1", NodeId: m.nodeID, IdentityGeneration: 1, Kind: wire.KindNodeFacts, Args: []byte("{}"),
				IssuedAtUnixMs: now.UnixMilli(), ExpiresAtUnixMs: now.Add(time.Minute).UnixMilli()}
			for _, o := range opts {
				o(b)
			}
			out, _ := proto.Marshal(b)
			return out
		}
		signWith := func(k *ecdsa.PrivateKey, b []byte) *agentv1.SignedCommand {
			sig, err := pki.SignPurpose(k, pki.PurposeCommand, b)
			if err != nil {
				t.Fatal(err)
			}
			return &agentv1.SignedCommand{Body: b, Sig: sig}
		}
		cmdKey, ok := h.e.Bundle.CommandSigningKey.(*ecdsa.PrivateKey)
		if !ok {
			t.Fatal("command-signing key is not ECDSA")
		}
		good := body()
		wrongPurpose, _ := pki.SignPurpose(cmdKey, pki.PurposeRenewPoP, good)
		// An identity saved before bcd kept the generation, joined a minute ago.
		legacy := *m.id
		legacy.IdentityGeneration = 0
		legacy.JoinedAt = now.Add(-time.Minute)
		tests := []struct {
			name string
			id   *identity.Identity
			sc   *agentv1.SignedCommand
			want string
		}{
			{"signed by the command-signing key", m.id, signWith(cmdKey, good), ""},
			{"re-signed with another key", m.id, signWith(other, good), run.RefusedSignature},
			{"signed for another purpose", m.id, &agentv1.SignedCommand{Body: good, Sig: wrongPurpose}, run.RefusedSignature},
			{"body altered after signing", m.id, &agentv1.SignedCommand{Body: body(func(b *agentv1.CommandBody) { b.NodeId = "node_other" }), Sig: signWith(cmdKey, good).Sig}, run.RefusedSignature},
			{"another node", m.id, signWith(cmdKey, body(func(b *agentv1.CommandBody) { b.NodeId = "node_01other" })), run.RefusedNode},
			{"another generation", m.id, signWith(cmdKey, body(func(b *agentv1.CommandBody) { b.IdentityGeneration = 2 })), run.RefusedGeneration},
			{"no generation", m.id, signWith(cmdKey, body(func(b *agentv1.CommandBody) { b.IdentityGeneration = 0 })), run.RefusedGeneration},
			{"expired", m.id, signWith(cmdKey, body(func(b *agentv1.CommandBody) { b.ExpiresAtUnixMs = now.Add(-time.Second).UnixMilli() })), run.RefusedExpired},
			{"not a command body", m.id, signWith(cmdKey, []byte{0xff, 0xff}), run.RefusedMalformed},
			{"unknown generation: issued after the join", &legacy, signWith(cmdKey, body(func(b *agentv1.CommandBody) { b.IdentityGeneration = 7 })), ""},
			{"unknown generation: issued before the join", &legacy, signWith(cmdKey, body(func(b *agentv1.CommandBody) {
				b.IssuedAtUnixMs = now.Add(-2 * time.Minute).UnixMilli()
			})), run.RefusedGeneration},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				_, got := run.Verify(tc.id, tc.sc, now)
				if got != tc.want {
					t.Errorf("Verify = %q, want %q", got, tc.want)
				}
			})
		}
	})
}
