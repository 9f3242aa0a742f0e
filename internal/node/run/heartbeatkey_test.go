package run_test

import (
	"bytes"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R12.1: bcd's heartbeat key through a relay that tampers with the key
// exchange, bcd's real loop on both sides of the API's switch. Relayed
// honestly, bcd's heartbeats are MAC'd when the API agreed a key (and
// signed otherwise) and keep the session alive. A relay that puts its own
// key in Welcome shares a key with bcd (it can compute bcd's MACs), but
// not with the API: the session ends at bcd's first heartbeat. A relay
// that strips the API's key makes bcd sign, which a keyed session does
// not take: it ends too. A relay that strips or replaces bcd's key in
// Hello breaks the proof: the session is refused (session-proof).
func TestR12_1HeartbeatKeyThroughRelay(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		relayKey, err := pki.NewHeartbeatKeyShare()
		if err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name    string
			hello   func(*agentv1.Hello)
			welcome func(*agentv1.Welcome)
			// want is how the session ends after bcd's first heartbeat (""
			// it lives on); refused: Hello is refused.
			want    string
			refused bool
		}{
			{name: "relayed honestly"},
			{name: "the API's key replaced", want: h.heartbeatReason(),
				welcome: func(w *agentv1.Welcome) { w.HeartbeatKey = relayKey.PublicKey().Bytes() }},
			{name: "the API's key stripped", want: map[bool]string{true: "heartbeat-mac"}[h.mac],
				welcome: func(w *agentv1.Welcome) { w.HeartbeatKey = nil }},
			{name: "bcd's key stripped", refused: true, hello: func(hl *agentv1.Hello) { hl.HeartbeatKey = nil }},
			{name: "bcd's key replaced", refused: true, hello: func(hl *agentv1.Hello) { hl.HeartbeatKey = relayKey.PublicKey().Bytes() }},
		}
		for i, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				m := h.join(t, h.token(t, h.pool(t, "relay-"+string(rune('a'+i)), nil), false), 150+i, 2)
				evil := h.newEvilGateway(t)
				evil.set(func(g *evilGateway) { g.hello, g.welcome = tc.hello, tc.welcome })
				p := h.startVia(t, m, evil.url)
				if tc.refused {
					eventually(t, "the session refused", func() bool { return h.refusedWith(t, m.nodeID, "session-proof") })
					if n := h.node(t, m.nodeID); n.Connection != store.Disconnected {
						t.Errorf("the node is %s", n.Connection)
					}
					return
				}
				p.welcome(t)
				connected := h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })
				h.clock.Advance(session.DefaultTouchEvery + time.Second) // so the heartbeat is written
				if err := p.clock.WaitArmed(ctxT(t), 2); err != nil {
					t.Fatal(err)
				}
				h.dbClockPast(t, *connected.LastSeen)
				p.clock.Advance(session.DefaultHeartbeat)
				if tc.want == "" {
					h.waitNode(t, m.nodeID, "the heartbeat recorded", func(n store.Node) bool { return n.LastSeen.After(*connected.LastSeen) })
					if !h.e.Server.Sessions().Connected(m.nodeID) {
						t.Fatal("the session ended while heartbeats flowed")
					}
				} else {
					h.waitNode(t, m.nodeID, "disconnected", func(n store.Node) bool { return n.Connection == store.Disconnected })
					if !h.disconnectedBecause(t, m.nodeID, tc.want) {
						t.Errorf("no node.disconnected event with reason %s", tc.want)
					}
				}
				evil.mu.Lock()
				hb, hello, nonce := evil.heartbeats[0], evil.hellos[0], evil.nonce
				evil.mu.Unlock()
				if len(hello.GetHeartbeatKey()) != pki.HeartbeatKeySize {
					t.Errorf("bcd offered heartbeat key %x", hello.GetHeartbeatKey())
				}
				keyed := h.mac && tc.welcome == nil || tc.name == "the API's key replaced"
				if keyed != (len(hb.GetMac()) > 0) || keyed == (len(hb.GetSig()) > 0) {
					t.Errorf("bcd's heartbeat %v, want MAC'd: %v", hb, keyed)
				}
				if tc.name == "the API's key replaced" {
					// The relay holds the key bcd MACs with.
					k, err := pki.DeriveHeartbeatKey(relayKey, pki.HeartbeatKeyParams{Nonce: nonce, NodeID: m.nodeID, CertDER: m.id.Leaf().Raw,
						DaemonKey: hello.GetHeartbeatKey(), APIKey: relayKey.PublicKey().Bytes()})
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(pki.NewHeartbeatMAC(k, nonce).Sum(hb.GetSeq()), hb.GetMac()) {
						t.Error("the relay cannot compute bcd's MAC")
					}
				}
			})
		}
	})
}
