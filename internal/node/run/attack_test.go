package run_test

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/commands"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Attacks by a relay or a stolen credential, each against the real API (and, where a
// relay is the attacker, with the gateway's own certificate and client
// identity).

// R12.1: with the gateway's client credentials and only a node's
// certificate (public), a session is refused: the API's Challenge must be
// signed by the node key. The node is never connected and its queued
// command is never sent.
func TestR12_1SessionNeedsNodeKey(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 60, 2)
		der := m.id.Leaf().Raw
		cmdID := h.enqueue(t, m.nodeID)
		otherKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		// A proof the real node made for an earlier session's nonce (the
		// relay saw it go by).
		earlier := make([]byte, pki.SessionNonceSize)
		_, _ = rand.Read(earlier)
		captured, err := pki.SignSessionProof(m.id.Signer, earlier, m.nodeID, der, nil)
		if err != nil {
			t.Fatal(err)
		}
		hello := func(proof, hbKey []byte) *agentv1.SessionClientMessage {
			return &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof, HeartbeatKey: hbKey}}}
		}
		// The daemon's heartbeat key and the relay's.
		daemonKey, relayKey := newShare(t), newShare(t)
		withKey := func(nonce []byte) []byte {
			p, _ := pki.SignSessionProof(m.id.Signer, nonce, m.nodeID, der, daemonKey)
			return p
		}
		tests := []struct {
			name string
			// proof answers the nonce; nil: Hello is sent before reading
			// the Challenge, without a proof.
			proof func(nonce []byte) []byte
			// hbKey is the heartbeat key Hello carries.
			hbKey []byte
		}{
			// The relay strips the daemon's heartbeat key (so that its
			// heartbeats stay signed, or to put its own in): the proof
			// covered it.
			{name: "the daemon's heartbeat key stripped", proof: withKey},
			{name: "the daemon's heartbeat key replaced", proof: withKey, hbKey: relayKey},
			{name: "Hello first, no proof"},
			{name: "no proof", proof: func([]byte) []byte { return nil }},
			{name: "proof by another key", proof: func(nonce []byte) []byte {
				p, _ := pki.SignSessionProof(otherKey, nonce, m.nodeID, der, nil)
				return p
			}},
			{name: "the node's proof from another session", proof: func([]byte) []byte { return captured }},
			{name: "garbage", proof: func([]byte) []byte { return []byte("\x30\x06\x02\x01\x01\x02\x01\x01") }},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				before := h.refusals(t, m.nodeID, "session-proof")
				s := h.attacker(t, der)
				var err error
				if tc.proof == nil {
					err = s.Send(hello(nil, nil))
				} else {
					_ = s.Send(nil)
					var first *agentv1.SessionServerMessage
					if first, err = s.Receive(); err == nil {
						if first.GetChallenge() == nil {
							t.Fatalf("first message %v, want a Challenge", first)
						}
						err = s.Send(hello(tc.proof(first.GetChallenge().GetNonce()), tc.hbKey))
					}
				}
				if err != nil && !errors.Is(err, io.EOF) {
					t.Fatal(err)
				}
				var got *agentv1.SessionServerMessage
				for err == nil || errors.Is(err, io.EOF) {
					if got, err = s.Receive(); err == nil && got.GetChallenge() == nil {
						t.Fatalf("the attacker got %v", got)
					}
				}
				pe, ok := errs.As(wire.FromWire(err))
				if !ok || pe.Code != errs.AccessDenied || pe.Message != "Session refused" {
					t.Fatalf("got %v, want ACCESS_DENIED Session refused", err)
				}
				if n := h.refusals(t, m.nodeID, "session-proof"); n != before+1 {
					t.Errorf("%d new security.session.refused events with reason session-proof, want 1", n-before)
				}
				// The refusal came before the session existed: nothing was
				// marked or sent.
				if n := h.node(t, m.nodeID); n.Connection != store.Disconnected {
					t.Errorf("the node is %s", n.Connection)
				}
				if c := h.command(t, cmdID); c.State != store.CommandQueued || c.SentAt != nil {
					t.Errorf("command %s is %s (sent %v)", cmdID, c.State, c.SentAt)
				}
			})
		}
		for _, ev := range h.events(t, "node.connected") {
			if ev.Subject == m.nodeID {
				t.Errorf("node.connected for a session without the node key: %s", ev.Data)
			}
		}
	})
}

// R12.3: a result the relay forged, or stripped of its signature, is not
// stored: the session ends (reason result-signature), and the command is
// delivered again on the next session, where bcd, which ran it already,
// answers "replayed" instead of running it twice.
func TestR12_3ForgedResultRefused(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		otherKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name   string
			tamper func(r *agentv1.CommandResult) *agentv1.CommandResult
		}{
			{name: "forged output", tamper: func(r *agentv1.CommandResult) *agentv1.CommandResult {
				r.Output = []byte(`{"cpus":999,"gpus":8,"memoryBytes":1,"hostname":"forged"}`)
				return r
			}},
			{name: "signature removed", tamper: func(r *agentv1.CommandResult) *agentv1.CommandResult { r.Sig = nil; return r }},
			{name: "unsigned gateway refusal of an allowed kind", tamper: func(r *agentv1.CommandResult) *agentv1.CommandResult {
				return &agentv1.CommandResult{CommandId: r.CommandId, Error: wire.GatewayKindRefused}
			}},
			{name: "failure signed by another key", tamper: func(r *agentv1.CommandResult) *agentv1.CommandResult {
				f := &agentv1.CommandResult{CommandId: r.CommandId, Error: "disk on fire"}
				f.Sig, _ = pki.SignCommandResult(otherKey, pki.CommandResult{CommandID: r.CommandId, Error: f.Error})
				return f
			}},
		}
		for i, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				m := h.join(t, h.token(t, h.pool(t, "forge-"+string(rune('a'+i)), nil), false), 70+i, 2)
				evil := h.newEvilGateway(t)
				evil.set(func(g *evilGateway) {
					g.tamper = func(n int, r *agentv1.CommandResult) *agentv1.CommandResult {
						if n > 0 {
							return r // only the first answer is forged
						}
						return tc.tamper(proto.Clone(r).(*agentv1.CommandResult))
					}
				})
				p := h.startVia(t, m, evil.url)
				p.welcome(t)
				id := h.enqueue(t, m.nodeID)
				eventually(t, "the result-signature refusal", func() bool { return h.refusedWith(t, m.nodeID, "result-signature") })
				p.reconnect(t)
				c := h.waitCommand(t, id)
				if c.State != store.CommandFailed || c.Error != run.RefusedReplayed || len(c.Result) != 0 {
					t.Errorf("command %s %q result %s, want failed %q without a result", c.State, c.Error, c.Result, run.RefusedReplayed)
				}
				for _, a := range h.audit(t, m.nodeID) {
					if a.Action == "command.done" {
						t.Errorf("a forged result was audited as done: %s", a.Data)
					}
				}
				if !h.disconnectedBecause(t, m.nodeID, "result-signature") {
					t.Error("no node.disconnected event with reason result-signature")
				}
			})
		}
	})
}

// R12.3: a captured signed command replayed by a relay, three times, after
// bcd restarted, is answered "replayed" (signed by the node) and never
// runs again: the command ids bcd ran live on disk until they expire.
func TestR12_3ReplayedCommandRefusedAcrossRestart(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 80, 2)
		evil := h.newEvilGateway(t)
		p := h.startVia(t, m, evil.url)
		p.welcome(t)
		id := h.enqueue(t, m.nodeID)
		done := h.waitCommand(t, id)
		if done.State != store.CommandDone {
			t.Fatalf("command %s %q", done.State, done.Error)
		}
		captured, seen := evil.snapshot()
		if len(captured) != 1 {
			t.Fatalf("the relay saw %d commands", len(captured))
		}
		p.stop(t)

		evil.set(func(g *evilGateway) { g.inject = []*agentv1.SignedCommand{captured[0], captured[0], captured[0]} })
		p2 := h.startVia(t, m, evil.url) // bcd restarted: a new process, the same data directory
		p2.welcome(t)
		replays := waitResults(t, evil, len(seen), id, 3)
		for _, r := range replays {
			if r.GetOk() || r.GetError() != run.RefusedReplayed || len(r.GetOutput()) != 0 {
				t.Errorf("replay answered %v, want refused %q", r, run.RefusedReplayed)
			}
			if err := pki.VerifyCommandResult(m.id.Leaf().PublicKey, pki.CommandResult{CommandID: id, NodeID: m.nodeID, IdentityGeneration: 1,
				Error: r.GetError()}, r.GetSig()); err != nil {
				t.Errorf("bcd's refusal is not signed by the node key: %v", err)
			}
		}
		if c := h.command(t, id); c.State != store.CommandDone || c.Error != "" || !strings.Contains(string(c.Result), `"cpus":2`) {
			t.Errorf("the command's first answer changed: %s %q %s", c.State, c.Error, c.Result)
		}
	})
}

// R12.3: after a reclaim (generation 2, a new install of the machine), a
// command captured from generation 1 and replayed to the new install, also
// after it restarted, is refused ("generation"): its id is new to the new
// install's data directory, so the generation is what stops it.
func TestR12_3OtherGenerationRefused(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		tok := h.token(t, h.pool(t, "p", nil), true)
		old := h.join(t, tok, 90, 2)
		evil := h.newEvilGateway(t)
		p := h.startVia(t, old, evil.url)
		p.welcome(t)
		id := h.enqueue(t, old.nodeID)
		h.waitCommand(t, id)
		captured, seen := evil.snapshot()
		if len(captured) != 1 {
			t.Fatalf("the relay saw %d commands", len(captured))
		}
		p.stop(t)

		reinstalled := h.join(t, tok, 90, 2) // the same machine, a new key: a reclaim
		if reinstalled.nodeID != old.nodeID || reinstalled.id.IdentityGeneration != 2 {
			t.Fatalf("reclaim: node %s generation %d", reinstalled.nodeID, reinstalled.id.IdentityGeneration)
		}
		p2 := h.startVia(t, reinstalled, evil.url)
		p2.welcome(t)
		p2.stop(t) // and a restart
		evil.set(func(g *evilGateway) { g.inject = []*agentv1.SignedCommand{captured[0]} })
		p3 := h.startVia(t, reinstalled, evil.url)
		p3.welcome(t)
		r := waitResults(t, evil, len(seen), id, 1)[0]
		if r.GetOk() || r.GetError() != run.RefusedGeneration {
			t.Errorf("a generation-1 command answered %v, want refused %q", r, run.RefusedGeneration)
		}
	})
}

// waitResults waits until the relay saw n results for command id after
// the first skip results it saw, and returns them.
func waitResults(t *testing.T, g *evilGateway, skip int, id string, n int) []*agentv1.CommandResult {
	t.Helper()
	var got []*agentv1.CommandResult
	eventually(t, "the node's answers", func() bool {
		got = got[:0]
		_, results := g.snapshot()
		for _, r := range results[skip:] {
			if r.GetCommandId() == id {
				got = append(got, r)
			}
		}
		return len(got) >= n
	})
	return got
}

// reconnect moves bcd's clock a second at a time until it opened a new
// session (its reconnect backoff passed), and returns the Welcome's node.
func (p *bcdProc) reconnect(t testing.TB) string {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		p.clock.Advance(time.Second)
		select {
		case id := <-p.welcomes:
			return id
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("bcd did not reconnect")
		}
	}
}

// ctxT is a context for a test's waits.
func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// R12.1: a relay cannot keep a session alive after its daemon went away.
// The relay (the gateway's credentials) carries a real session, the node
// key answering the Challenge and the daemon's heartbeat key (MAC on)
// making one heartbeat, as bcd would; then the daemon is gone and the
// relay goes on alone: a replayed heartbeat, an unsigned one, one signed
// by another key or, on a keyed session, MAC'd under another key or under
// the key the relay would share with bcd had it replaced the API's key in
// Welcome, ends the session (heartbeat-signature, or heartbeat-mac on a
// keyed session), and silence ends it as idle; each time the node is
// disconnected.
func TestR12_1RelayCannotKeepSessionAlive(t *testing.T) {
	eachBeat(t, func(t *testing.T, h *harness) {
		heartbeat := func(hb *agentv1.Heartbeat) *agentv1.SessionClientMessage {
			return &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: hb}}
		}
		// relayKey is the key a relay would put in Welcome in place of the
		// API's.
		relayKey, err := pki.NewHeartbeatKeyShare()
		if err != nil {
			t.Fatal(err)
		}
		tests := []struct {
			name string
			// alone is what the relay does once the daemon is gone, given
			// the daemon's first heartbeat and its session.
			alone      func(t *testing.T, s sessionStream, first *agentv1.SessionClientMessage, ks keyedSession)
			wantReason string
			macOnly    bool
		}{
			{name: "replays the daemon's heartbeat", wantReason: h.heartbeatReason(),
				alone: func(t *testing.T, s sessionStream, first *agentv1.SessionClientMessage, _ keyedSession) {
					_ = s.Send(first)
				}},
			{name: "sends unsigned heartbeats", wantReason: h.heartbeatReason(),
				alone: func(t *testing.T, s sessionStream, _ *agentv1.SessionClientMessage, _ keyedSession) {
					_ = s.Send(heartbeat(&agentv1.Heartbeat{Seq: 2}))
				}},
			{name: "signs with another key", wantReason: h.heartbeatReason(),
				alone: func(t *testing.T, s sessionStream, _ *agentv1.SessionClientMessage, ks keyedSession) {
					k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
					sig, _ := pki.SignHeartbeat(k, ks.nonce, 2)
					_ = s.Send(heartbeat(&agentv1.Heartbeat{Seq: 2, Sig: sig}))
				}},
			{name: "MACs under another key", wantReason: "heartbeat-mac", macOnly: true,
				alone: func(t *testing.T, s sessionStream, _ *agentv1.SessionClientMessage, ks keyedSession) {
					forged := pki.NewHeartbeatMAC(make([]byte, pki.HeartbeatKeySize), ks.nonce)
					_ = s.Send(heartbeat(&agentv1.Heartbeat{Seq: 2, Mac: forged.Sum(2)}))
				}},
			{name: "MACs under the key it would share with bcd", wantReason: "heartbeat-mac", macOnly: true,
				alone: func(t *testing.T, s sessionStream, _ *agentv1.SessionClientMessage, ks keyedSession) {
					// The relay replaced the API's key with its own: it and
					// bcd derive this key; the API does not.
					p := ks.params
					p.APIKey = relayKey.PublicKey().Bytes()
					k, err := pki.DeriveHeartbeatKey(relayKey, p)
					if err != nil {
						t.Fatal(err)
					}
					_ = s.Send(heartbeat(&agentv1.Heartbeat{Seq: 2, Mac: pki.NewHeartbeatMAC(k, ks.nonce).Sum(2)}))
				}},
			{name: "stays silent", wantReason: "idle",
				alone: func(t *testing.T, _ sessionStream, _ *agentv1.SessionClientMessage, _ keyedSession) {
					h.clock.Advance(3*session.DefaultHeartbeat + session.DefaultCheck) // three heartbeats and a check
				}},
		}
		for i, tc := range tests {
			if tc.macOnly && !h.mac {
				continue
			}
			t.Run(tc.name, func(t *testing.T) {
				m := h.join(t, h.token(t, h.pool(t, "alive-"+string(rune('a'+i)), nil), false), 130+i, 2)
				s := h.attacker(t, m.id.Leaf().Raw)
				ks := openKeyedSession(t, s, m) // the daemon, relayed
				connected := h.waitNode(t, m.nodeID, "connected", func(n store.Node) bool { return n.Connection == store.Connected })
				if (ks.mac != nil) != h.mac {
					t.Fatalf("a heartbeat key agreed: %v, want %v", ks.mac != nil, h.mac)
				}
				if err := h.clock.WaitArmed(ctxT(t), 1); err != nil {
					t.Fatal(err)
				}
				// The daemon's heartbeat, recorded (a heartbeat is written
				// at most every TouchEvery): the API has taken it before
				// the relay is alone.
				h.clock.Advance(session.DefaultTouchEvery + time.Second)
				hb := heartbeat(ks.beat(t, 1))
				h.dbClockPast(t, *connected.LastSeen) // so the heartbeat's write shows
				if err := s.Send(hb); err != nil {
					t.Fatal(err)
				}
				h.waitNode(t, m.nodeID, "the heartbeat recorded", func(n store.Node) bool { return n.LastSeen.After(*connected.LastSeen) })
				tc.alone(t, s, hb, ks)
				h.waitNode(t, m.nodeID, "disconnected", func(n store.Node) bool { return n.Connection == store.Disconnected })
				if !h.disconnectedBecause(t, m.nodeID, tc.wantReason) {
					var got []string
					for _, ev := range h.events(t, "node.disconnected") {
						if ev.Subject == m.nodeID {
							got = append(got, string(ev.Data))
						}
					}
					t.Errorf("no node.disconnected event with reason %s: %v", tc.wantReason, got)
				}
				for {
					if _, err = s.Receive(); err != nil {
						break
					}
				}
				if tc.wantReason != "idle" {
					if pe, ok := errs.As(wire.FromWire(err)); !ok || pe.Code != errs.AccessDenied || pe.Message != "Session refused" {
						t.Errorf("the relay got %v, want ACCESS_DENIED Session refused", err)
					}
				}
			})
		}
	})
}

// newShare is a fresh X25519 public key, as bcd offers in Hello.
func newShare(t *testing.T) []byte {
	t.Helper()
	k, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		t.Fatal(err)
	}
	return k.PublicKey().Bytes()
}

// keyedSession is a session opened as bcd opens it, offering a heartbeat
// key: its nonce, what its key is bound to, and its heartbeat MAC when
// the API agreed a key (nil: heartbeats are signed).
type keyedSession struct {
	nonce  []byte
	params pki.HeartbeatKeyParams
	mac    *pki.HeartbeatMAC
	signer crypto.Signer
}

// openKeyedSession answers s's Challenge as bcd does, with m's proof over
// a fresh heartbeat key, and derives the session's heartbeat key from the
// Welcome.
func openKeyedSession(t *testing.T, s sessionStream, m *machine) keyedSession {
	t.Helper()
	_ = s.Send(nil)
	first, err := s.Receive()
	if err != nil {
		t.Fatal(err)
	}
	nonce := first.GetChallenge().GetNonce()
	share, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		t.Fatal(err)
	}
	der := m.id.Leaf().Raw
	proof, err := pki.SignSessionProof(m.id.Signer, nonce, m.nodeID, der, share.PublicKey().Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof,
		HeartbeatKey: share.PublicKey().Bytes()}}}); err != nil {
		t.Fatal(err)
	}
	w, err := s.Receive()
	if err != nil || w.GetWelcome() == nil {
		t.Fatalf("Welcome: %v %v", w, err)
	}
	ks := keyedSession{nonce: nonce, signer: m.id.Signer,
		params: pki.HeartbeatKeyParams{Nonce: nonce, NodeID: m.nodeID, CertDER: der, DaemonKey: share.PublicKey().Bytes()}}
	if apiKey := w.GetWelcome().GetHeartbeatKey(); len(apiKey) > 0 {
		ks.params.APIKey = apiKey
		k, err := pki.DeriveHeartbeatKey(share, ks.params)
		if err != nil {
			t.Fatal(err)
		}
		ks.mac = pki.NewHeartbeatMAC(k, nonce)
	}
	return ks
}

// beat is the daemon's seq-th heartbeat on the session.
func (ks keyedSession) beat(t *testing.T, seq uint64) *agentv1.Heartbeat {
	t.Helper()
	if ks.mac != nil {
		return &agentv1.Heartbeat{Seq: seq, Mac: ks.mac.Sum(seq)}
	}
	sig, err := pki.SignHeartbeat(ks.signer, ks.nonce, seq)
	if err != nil {
		t.Fatal(err)
	}
	return &agentv1.Heartbeat{Seq: seq, Sig: sig}
}

// sessionStream is a client session stream.
type sessionStream = *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]

// R21.4: a compromised gateway forges the unsigned time of every Welcome
// (a day back or ahead). Welcome's time moves nothing: a command bcd ran,
// captured and injected again after its expiry, is refused as expired (a
// day-back Welcome made an older bcd take it for unexpired, and run it
// again once its run list had forgotten it); the learned offset is not
// moved or persisted (a day-ahead one made an older bcd stop renewing and
// refuse to start); and once the honest gateway is back bcd runs as
// before.
func TestForgedWelcomeTimeR21_4(t *testing.T) {
	for _, forged := range []time.Duration{-24 * time.Hour, -23 * time.Hour, 23 * time.Hour, 24 * time.Hour} {
		t.Run(forged.String(), func(t *testing.T) {
			eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
				m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 85, 2)
				offBefore, _, _ := servertime.Read(m.store.Dir)
				evil := h.newEvilGateway(t)
				p := h.startVia(t, m, evil.url)
				p.welcome(t)
				first := h.enqueue(t, m.nodeID)
				if c := h.waitCommand(t, first); c.State != store.CommandDone {
					t.Fatalf("command %s %q", c.State, c.Error)
				}
				captured, _ := evil.snapshot()
				if len(captured) != 1 {
					t.Fatalf("the relay saw %d commands", len(captured))
				}
				p.stop(t)

				// This machine's clock moves on past the command's expiry and
				// past what an older bcd remembered it for.
				h.bcdAhead = commands.DefaultTTL + 15*time.Minute
				evil.set(func(g *evilGateway) { g.welcomeShift = forged })
				_, seen := evil.snapshot()
				evil.set(func(g *evilGateway) { g.inject = []*agentv1.SignedCommand{captured[0]} })
				p3 := h.startVia(t, m, evil.url)
				p3.welcome(t)
				r := waitResults(t, evil, len(seen), first, 1)[0]
				if r.GetOk() || r.GetError() != run.RefusedExpired {
					t.Errorf("the expired command injected under a forged Welcome time answered %v, want refused %q", r, run.RefusedExpired)
				}
				p3.stop(t)
				if off, _, _ := servertime.Read(m.store.Dir); off != offBefore {
					t.Errorf("the persisted offset moved from %s to %s", offBefore, off)
				}

				// The honest gateway again, and this machine's clock right:
				// bcd runs.
				h.bcdAhead = 0
				evil.set(func(g *evilGateway) { g.welcomeShift, g.inject = 0, nil })
				p4 := h.startVia(t, m, evil.url)
				p4.welcome(t)
				again := h.enqueue(t, m.nodeID)
				if c := h.waitCommand(t, again); c.State != store.CommandDone {
					t.Fatalf("after the gateway was repaired: %s %q", c.State, c.Error)
				}
			})
		})
	}
}

// R7.5: the real gateway checks each command's kind against the kinds
// Welcome names, at dispatch, on either relay. A relay between the
// gateway and the API narrows Welcome's kinds and injects a command of
// another kind, validly signed: the gateway answers it with its unsigned
// refusal (which the relay keeps from the API) and bcd never gets it,
// while the session goes on and relays the commands it allows.
func TestGatewayRefusesKindR7_5(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 195, 2)
		cmdKey, ok := h.e.Bundle.CommandSigningKey.(*ecdsa.PrivateKey)
		if !ok {
			t.Fatal("command-signing key is not ECDSA")
		}
		now := time.Now()
		const injected = "cmd_injected_acceptance"
		body, err := proto.Marshal(&agentv1.CommandBody{CommandId: injected, NodeId: m.nodeID, IdentityGeneration: m.id.IdentityGeneration,
			Kind: wire.KindAcceptanceCheck, Args: []byte("{}"), IssuedAtUnixMs: now.UnixMilli(), ExpiresAtUnixMs: now.Add(time.Minute).UnixMilli()})
		if err != nil {
			t.Fatal(err)
		}
		sig, err := pki.SignPurpose(cmdKey, pki.PurposeCommand, body)
		if err != nil {
			t.Fatal(err)
		}
		evil := h.newEvilGateway(t)
		evil.set(func(g *evilGateway) {
			g.behind = true
			g.welcome = func(w *agentv1.Welcome) { w.AllowedKinds = []string{"node.*"} }
			g.inject = []*agentv1.SignedCommand{{Body: body, Sig: sig}}
			g.tamper = func(_ int, r *agentv1.CommandResult) *agentv1.CommandResult {
				if r.GetCommandId() == injected {
					return nil // the API never sent it
				}
				return r
			}
		})
		gwAddr, _ := h.startGateway(t, evil.url)
		p := h.startVia(t, m, "https://"+gwAddr)
		p.welcome(t)
		refusal := waitResults(t, evil, 0, injected, 1)[0]
		if refusal.GetOk() || refusal.GetError() != wire.GatewayKindRefused || len(refusal.GetSig()) != 0 || len(refusal.GetOutput()) != 0 {
			t.Errorf("the gateway answered the injected command with %v, want its unsigned refusal", refusal)
		}
		// An allowed kind goes through on the same session, and bcd's
		// answers name only it.
		id := h.enqueue(t, m.nodeID)
		if c := h.waitCommand(t, id); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":2`) {
			t.Errorf("command %s %q %s", c.State, c.Error, c.Result)
		}
		_, results := evil.snapshot()
		for _, r := range results {
			if r.GetCommandId() == injected && len(r.GetSig()) != 0 {
				t.Errorf("bcd answered the command the gateway refused: %v", r)
			}
		}
		var sessions int
		evil.set(func(g *evilGateway) { sessions = g.upstreams })
		if sessions != 1 {
			t.Errorf("%d sessions relayed, want 1: the refusal ended the session", sessions)
		}
	})
}
