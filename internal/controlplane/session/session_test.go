package session

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R12.1: what the database says about a held session, and why it ends.
// The full path (a real session ended within one check) is in
// internal/node/run's TestR12_1SessionEndsWithinASecond.
func TestEnded(t *testing.T) {
	c := &conn{id: "sess_1", nodeID: "node_1", generation: 2}
	now := time.Now()
	live := store.SessionState{NodeID: "node_1", NodeFound: true, SessionID: "sess_1", State: store.NodeAdopted, IdentityGeneration: 2,
		CertFound: true, CertGeneration: 2}
	tests := []struct {
		name   string
		change func(s *store.SessionState)
		want   string
	}{
		{"live", func(*store.SessionState) {}, ""},
		{"node gone", func(s *store.SessionState) { *s = store.SessionState{NodeID: "node_1"} }, endNodeGone},
		{"retired (certificates revoked too)", func(s *store.SessionState) { s.State = store.NodeRetired; s.CertRevoked = true }, EndRetired},
		{"reclaimed", func(s *store.SessionState) { s.IdentityGeneration = 3 }, EndReclaimed},
		{"certificate revoked", func(s *store.SessionState) { s.CertRevoked = true }, EndRevoked},
		{"certificate not the node's", func(s *store.SessionState) { s.CertFound = false }, EndRevoked},
		{"a newer session elsewhere", func(s *store.SessionState) { s.SessionID = "sess_2" }, endReplaced},
		{"failed acceptance is still a session", func(s *store.SessionState) { s.State = store.NodeFailed }, ""},
		// a renewal supersedes the session's certificate; it
		// serves for the overlap, then bcd moves to its new one.
		{"superseded within the overlap", func(s *store.SessionState) {
			at := now.Add(-nodeident.SessionOverlap + time.Second)
			s.CertSupersededAt = &at
		}, ""},
		{"superseded longer ago than the overlap", func(s *store.SessionState) {
			at := now.Add(-nodeident.SessionOverlap)
			s.CertSupersededAt = &at
		}, endSuperseded},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := live
			tc.change(&s)
			if got := ended(c, s, now); got != tc.want {
				t.Errorf("ended = %q, want %q", got, tc.want)
			}
		})
	}
	if e := endCause(EndRetired); e.Code != errs.InvalidState || e.Message != wire.NodeRetiredMessage {
		t.Errorf("retired cause %v", e)
	}
	for _, r := range []string{EndReclaimed, EndRevoked, endNodeGone} {
		if e := endCause(r); e.Code != errs.AccessDenied || e.Message != "Session refused" {
			t.Errorf("%s cause %v, want the uniform refusal", r, e)
		}
	}
}

// R12.3, R7.5: which results may be stored.
func TestCheckResult(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	other, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	c := &conn{nodeID: "node_1", generation: 2, nodeKey: key.Public(), allowedKinds: []string{"node.*"}}
	cmd := store.Command{ID: "cmd_1", NodeID: "node_1", IdentityGeneration: 2, Kind: "node.facts"}
	blocked := store.Command{ID: "cmd_2", NodeID: "node_1", IdentityGeneration: 2, Kind: "shell.exec"}
	sign := func(k *ecdsa.PrivateKey, r pki.CommandResult) []byte {
		s, err := pki.SignCommandResult(k, r)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	out := []byte(`{"cpus":4}`)
	good := sign(key, pki.CommandResult{CommandID: "cmd_1", NodeID: "node_1", IdentityGeneration: 2, OK: true, Output: out})
	gwRefusal := &agentv1.CommandResult{CommandId: "cmd_2", Error: wire.GatewayKindRefused}
	tests := []struct {
		name string
		cmd  store.Command
		r    *agentv1.CommandResult
		want string
	}{
		{"signed by the node", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: out, Sig: good}, ""},
		{"output changed", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: []byte(`{"cpus":400}`), Sig: good}, reasonResultSignature},
		{"unsigned", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: out}, reasonResultSignature},
		{"signed by another key", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: out,
			Sig: sign(other, pki.CommandResult{CommandID: "cmd_1", NodeID: "node_1", IdentityGeneration: 2, OK: true, Output: out})}, reasonResultSignature},
		{"signed for another generation", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Ok: true, Output: out,
			Sig: sign(key, pki.CommandResult{CommandID: "cmd_1", NodeID: "node_1", IdentityGeneration: 1, OK: true, Output: out})}, reasonResultSignature},
		{"gateway refusal of a kind the certificate refuses", blocked, gwRefusal, ""},
		{"gateway refusal of a kind the certificate allows", cmd, &agentv1.CommandResult{CommandId: "cmd_1", Error: wire.GatewayKindRefused}, reasonResultSignature},
		{"gateway refusal with output", blocked, &agentv1.CommandResult{CommandId: "cmd_2", Error: wire.GatewayKindRefused, Output: out}, reasonResultSignature},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := checkResult(c, tc.cmd, tc.r); got != tc.want {
				t.Errorf("checkResult = %q, want %q", got, tc.want)
			}
		})
	}
}

// R12.1: only the node key's heartbeats, over this session's nonce, in
// order, keep a session alive.
func TestCheckHeartbeat(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, pki.SessionNonceSize)
	_, _ = rand.Read(nonce)
	other := make([]byte, pki.SessionNonceSize)
	c := &conn{nodeKey: key.Public(), nonce: nonce}
	hb := func(n []byte, seq uint64) *agentv1.Heartbeat {
		sig, err := pki.SignHeartbeat(key, n, seq)
		if err != nil {
			t.Fatal(err)
		}
		return &agentv1.Heartbeat{Seq: seq, Sig: sig}
	}
	steps := []struct {
		name string
		hb   *agentv1.Heartbeat
		want string
	}{
		{"first", hb(nonce, 1), ""},
		{"the same again", hb(nonce, 1), reasonHeartbeatSignature},
		{"a gap is fine", hb(nonce, 3), ""},
		{"an earlier one", hb(nonce, 2), reasonHeartbeatSignature},
		{"another session's", hb(other, 4), reasonHeartbeatSignature},
		{"unsigned", &agentv1.Heartbeat{Seq: 5}, reasonHeartbeatSignature},
		{"next", hb(nonce, 4), ""},
	}
	for _, st := range steps {
		if got := checkHeartbeat(c, st.hb); got != st.want {
			t.Errorf("%s: %q, want %q", st.name, got, st.want)
		}
	}
	if c.lastSeq != 4 {
		t.Errorf("last seq %d, want 4", c.lastSeq)
	}
}

// R12.1: on a session that agreed a heartbeat key, only heartbeats MAC'd
// under it, over this session's nonce, in order, keep the session alive;
// a signature by the node key does not do instead (a relay that stripped
// the API's key from Welcome only ends the session).
func TestCheckHeartbeatMAC(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	nonce := make([]byte, pki.SessionNonceSize)
	_, _ = rand.Read(nonce)
	der := []byte("certificate DER")
	daemon, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		t.Fatal(err)
	}
	hello := &agentv1.Hello{HeartbeatKey: daemon.PublicKey().Bytes()}
	mac, apiKey, reason := agreeHeartbeatKey(der, "node_1", nonce, hello)
	if reason != "" || mac == nil || len(apiKey) != pki.HeartbeatKeySize {
		t.Fatalf("agree: %v %x %q", mac, apiKey, reason)
	}
	k, err := pki.DeriveHeartbeatKey(daemon, pki.HeartbeatKeyParams{Nonce: nonce, NodeID: "node_1", CertDER: der, DaemonKey: hello.HeartbeatKey, APIKey: apiKey})
	if err != nil {
		t.Fatal(err)
	}
	bcd := pki.NewHeartbeatMAC(k, nonce)
	c := &conn{nodeKey: key.Public(), nonce: nonce, mac: mac}
	sig, err := pki.SignHeartbeat(key, nonce, 5)
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		name string
		hb   *agentv1.Heartbeat
		want string
	}{
		{"first", &agentv1.Heartbeat{Seq: 1, Mac: bcd.Sum(1)}, ""},
		{"the same again", &agentv1.Heartbeat{Seq: 1, Mac: bcd.Sum(1)}, reasonHeartbeatMAC},
		{"a gap is fine", &agentv1.Heartbeat{Seq: 3, Mac: bcd.Sum(3)}, ""},
		{"an earlier one", &agentv1.Heartbeat{Seq: 2, Mac: bcd.Sum(2)}, reasonHeartbeatMAC},
		{"another seq's MAC", &agentv1.Heartbeat{Seq: 4, Mac: bcd.Sum(5)}, reasonHeartbeatMAC},
		{"another session's", &agentv1.Heartbeat{Seq: 4, Mac: pki.NewHeartbeatMAC(k, make([]byte, pki.SessionNonceSize)).Sum(4)}, reasonHeartbeatMAC},
		{"no MAC", &agentv1.Heartbeat{Seq: 4}, reasonHeartbeatMAC},
		{"signed instead", &agentv1.Heartbeat{Seq: 5, Sig: sig}, reasonHeartbeatMAC},
		{"next", &agentv1.Heartbeat{Seq: 4, Mac: bcd.Sum(4)}, ""},
	}
	for _, st := range steps {
		if got := checkHeartbeat(c, st.hb); got != st.want {
			t.Errorf("%s: %q, want %q", st.name, got, st.want)
		}
	}
	if c.lastSeq != 4 {
		t.Errorf("last seq %d, want 4", c.lastSeq)
	}
	// A daemon that offered no key keeps signing; a key that is not one
	// refuses the session.
	if mac, apiKey, reason := agreeHeartbeatKey(der, "node_1", nonce, &agentv1.Hello{}); mac != nil || apiKey != nil || reason != "" {
		t.Errorf("no key offered: %v %x %q", mac, apiKey, reason)
	}
	for _, bad := range [][]byte{make([]byte, pki.HeartbeatKeySize), []byte("short")} {
		if _, _, reason := agreeHeartbeatKey(der, "node_1", nonce, &agentv1.Hello{HeartbeatKey: bad}); reason != reasonHeartbeatKey {
			t.Errorf("key %x: %q, want %q", bad, reason, reasonHeartbeatKey)
		}
	}
}
