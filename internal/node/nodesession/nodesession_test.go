package nodesession_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/node/nodesession"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R19.3: the first reconnect after a session ended is drawn uniformly from
// [0, 10 s), so a fleet that lost its gateway does not come back in one
// burst; the next double from 2 s to at most 60 s, spread ±20% by the
// jitter.
func TestReconnectWait(t *testing.T) {
	for _, c := range []struct {
		n    int
		r    float64
		want time.Duration
	}{
		{1, 0, 0},
		{1, 0.25, 2500 * time.Millisecond},
		{1, 0.5, 5 * time.Second},
		{1, 0.999, 9990 * time.Millisecond},
		{0, 0.5, 5 * time.Second},
		{2, 0.5, 2 * time.Second},
		{2, 0, 1600 * time.Millisecond},
		{3, 1, 4800 * time.Millisecond},
		{7, 0.5, 60 * time.Second},
		{100, 0, 48 * time.Second},
		{100, 1, 72 * time.Second},
	} {
		if got := nodesession.ReconnectWait(c.n, c.r); got != c.want {
			t.Errorf("ReconnectWait(%d, %v) = %s, want %s", c.n, c.r, got, c.want)
		}
	}
	// A sweep of the jitter: the first waits cover the window, in order.
	prev := time.Duration(-1)
	for i := range 100 {
		got := nodesession.ReconnectWait(1, (float64(i)+0.5)/100)
		if got <= prev || got < 0 || got >= nodesession.FirstReconnectSpread {
			t.Fatalf("first wait %s after %s, want increasing within [0, %s)", got, prev, nodesession.FirstReconnectSpread)
		}
		prev = got
	}
}

func newOpening(t *testing.T) (*ecdsa.PrivateKey, []byte, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, pki.SessionNonceSize)
	_, _ = rand.Read(nonce)
	return key, nonce, []byte("certificate DER")
}

// R12.1, R21.2: Hello carries the proof over the nonce, the certificate
// and the offered heartbeat key, and the pins acknowledged over the
// nonce; both verify under the node key as the API checks them. A nonce
// that is no Challenge's is refused before anything is signed.
func TestAnswer(t *testing.T) {
	key, nonce, cert := newOpening(t)
	pin, err := pki.Pin(key.Public())
	if err != nil {
		t.Fatal(err)
	}
	pins := []string{pin}
	_, hello, err := nodesession.Answer(key, "node_1", cert, nonce, pins)
	if err != nil {
		t.Fatal(err)
	}
	if len(hello.GetHeartbeatKey()) == 0 || hello.GetProtocol() == 0 {
		t.Fatalf("hello %+v", hello)
	}
	if err := pki.VerifySessionProof(key.Public(), nonce, "node_1", cert, hello.GetHeartbeatKey(), hello.GetProof()); err != nil {
		t.Fatalf("proof: %v", err)
	}
	if err := pki.VerifyPinsAck(key.Public(), nonce, hello.GetPins(), hello.GetPinsSig()); err != nil || len(hello.GetPins()) != 1 {
		t.Fatalf("pins %v: %v", hello.GetPins(), err)
	}
	for _, bad := range [][]byte{nil, nonce[1:]} {
		if _, _, err := nodesession.Answer(key, "node_1", cert, bad, pins); !errors.Is(err, nodesession.ErrNoChallenge) {
			t.Errorf("nonce of %d bytes: %v", len(bad), err)
		}
	}
}

// R12.1: after a Welcome with the API's key share the heartbeats are
// MAC'd under the key the API derives too; without one they are signed
// by the node key. The interval is Welcome's, 15 s when it names none. A
// share that is no X25519 key fails.
func TestWelcomedHeartbeats(t *testing.T) {
	key, nonce, cert := newOpening(t)
	apiShare, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		welcome *agentv1.Welcome
		beat    time.Duration
		mac     bool
	}{
		{"MAC'd", &agentv1.Welcome{NodeId: "node_1", HeartbeatSeconds: 20, HeartbeatKey: apiShare.PublicKey().Bytes()}, 20 * time.Second, true},
		{"signed", &agentv1.Welcome{NodeId: "node_1"}, nodesession.DefaultHeartbeat, false},
	} {
		opening, hello, err := nodesession.Answer(key, "node_1", cert, nonce, nil)
		if err != nil {
			t.Fatal(err)
		}
		beats, beat, err := opening.Welcomed(c.welcome)
		if err != nil || beat != c.beat || beats.MACd() != c.mac {
			t.Fatalf("%s: beat %s, MAC'd %v, %v", c.name, beat, beats.MACd(), err)
		}
		hb, err := beats.Make(7)
		if err != nil || hb.GetSeq() != 7 {
			t.Fatalf("%s: %+v %v", c.name, hb, err)
		}
		if !c.mac {
			if err := pki.VerifyHeartbeat(key.Public(), beats.Nonce(), 7, hb.GetSig()); err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			continue
		}
		k, err := pki.DeriveHeartbeatKey(apiShare, pki.HeartbeatKeyParams{Nonce: nonce, NodeID: "node_1", CertDER: cert,
			DaemonKey: hello.GetHeartbeatKey(), APIKey: apiShare.PublicKey().Bytes()})
		if err != nil {
			t.Fatal(err)
		}
		if m := pki.NewHeartbeatMAC(k, nonce); !m.Verify(7, hb.GetMac()) || m.Verify(8, hb.GetMac()) {
			t.Fatalf("%s: the API's MAC does not check", c.name)
		}
	}
	opening, _, err := nodesession.Answer(key, "node_1", cert, nonce, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := opening.Welcomed(&agentv1.Welcome{NodeId: "node_1", HeartbeatKey: []byte("short")}); err == nil {
		t.Fatal("a garbage key share was accepted")
	}
}

// R12.3: a result is signed over the command, the node, the generation
// the command named and the outcome.
func TestSignResult(t *testing.T) {
	key, _, _ := newOpening(t)
	res, err := nodesession.SignResult(key, "node_1", 3, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	r := pki.CommandResult{CommandID: "cmd_1", NodeID: "node_1", IdentityGeneration: 3, OK: true, Output: []byte(`{}`)}
	if err := pki.VerifyCommandResult(key.Public(), r, res.GetSig()); err != nil || res.GetCommandId() != "cmd_1" || !res.GetOk() {
		t.Fatalf("%+v: %v", res, err)
	}
	r.IdentityGeneration = 4
	if pki.VerifyCommandResult(key.Public(), r, res.GetSig()) == nil {
		t.Fatal("verified for another generation")
	}
}
