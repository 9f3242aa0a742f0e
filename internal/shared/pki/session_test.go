package pki

import (
	"bytes"
	"crypto/rand"
	"errors"
	"testing"

	"pgregory.net/rapid"
)

// R12.1: a session proof verifies only for its nonce, node, certificate,
// key and purpose.
func TestSessionProof(t *testing.T) {
	key := newP256(t)
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	cert := []byte("certificate DER")
	sig, err := SignSessionProof(key, nonce, "node_1", cert, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "node_1", cert, nil, sig); err != nil {
		t.Fatalf("verify: %v", err)
	}
	other := append([]byte(nil), nonce...)
	other[0] ^= 1
	cmdSig, err := SignPurpose(key, PurposeCommand, SessionProofMessage(nonce, "node_1", cert, nil))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		verify  func() error
		wantSig bool
	}{
		{"another nonce", func() error { return VerifySessionProof(key.Public(), other, "node_1", cert, nil, sig) }, true},
		{"another node", func() error { return VerifySessionProof(key.Public(), nonce, "node_2", cert, nil, sig) }, true},
		{"another certificate", func() error { return VerifySessionProof(key.Public(), nonce, "node_1", []byte("other"), nil, sig) }, true},
		{"another key", func() error { return VerifySessionProof(newP256(t).Public(), nonce, "node_1", cert, nil, sig) }, true},
		{"another purpose", func() error { return VerifySessionProof(key.Public(), nonce, "node_1", cert, nil, cmdSig) }, true},
		{"no proof", func() error { return VerifySessionProof(key.Public(), nonce, "node_1", cert, nil, nil) }, true},
		{"short nonce", func() error { return VerifySessionProof(key.Public(), nonce[:31], "node_1", cert, nil, sig) }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.verify()
			if err == nil {
				t.Fatal("verified")
			}
			if errors.Is(err, ErrSignature) != tt.wantSig {
				t.Errorf("err = %v, ErrSignature %v", err, tt.wantSig)
			}
		})
	}
	if _, err := SignSessionProof(key, nonce[:16], "node_1", cert, nil); err == nil {
		t.Error("signed a proof over a 16-byte nonce")
	}
}

// R12.1: a heartbeat's signature is for one session and one place in it.
func TestHeartbeatSignature(t *testing.T) {
	key := newP256(t)
	nonce := make([]byte, SessionNonceSize)
	_, _ = rand.Read(nonce)
	sig, err := SignHeartbeat(key, nonce, 7)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyHeartbeat(key.Public(), nonce, 7, sig); err != nil {
		t.Fatalf("verify: %v", err)
	}
	other := append([]byte(nil), nonce...)
	other[31] ^= 1
	if err := VerifyHeartbeat(key.Public(), nonce, 8, sig); !errors.Is(err, ErrSignature) {
		t.Errorf("another seq: %v", err)
	}
	if err := VerifyHeartbeat(key.Public(), other, 7, sig); !errors.Is(err, ErrSignature) {
		t.Errorf("another session: %v", err)
	}
	if err := VerifySessionProof(key.Public(), nonce, "", nil, nil, sig); !errors.Is(err, ErrSignature) {
		t.Errorf("a heartbeat verified as a session proof: %v", err)
	}
	if _, err := SignHeartbeat(key, nonce[:8], 1); err == nil {
		t.Error("signed over an 8-byte nonce")
	}
}

// R12.3: a command result's signature covers every field.
func TestCommandResultSignature(t *testing.T) {
	key := newP256(t)
	r := CommandResult{CommandID: "cmd_1", NodeID: "node_1", IdentityGeneration: 2, OK: true, Output: []byte(`{"cpus":4}`), Error: ""}
	sig, err := SignCommandResult(key, r)
	if err != nil {
		t.Fatal(err)
	}
	if err := VerifyCommandResult(key.Public(), r, sig); err != nil {
		t.Fatalf("verify: %v", err)
	}
	for name, change := range map[string]func(*CommandResult){
		"command":    func(r *CommandResult) { r.CommandID = "cmd_2" },
		"node":       func(r *CommandResult) { r.NodeID = "node_2" },
		"generation": func(r *CommandResult) { r.IdentityGeneration = 1 },
		"ok":         func(r *CommandResult) { r.OK = false },
		"output":     func(r *CommandResult) { r.Output = []byte(`{"cpus":400}`) },
		"error":      func(r *CommandResult) { r.Error = "x" },
	} {
		t.Run(name, func(t *testing.T) {
			forged := r
			change(&forged)
			if err := VerifyCommandResult(key.Public(), forged, sig); !errors.Is(err, ErrSignature) {
				t.Fatalf("forged %s: %v", name, err)
			}
		})
	}
	// The session proof and the result never verify for each other.
	if err := VerifyPurpose(key.Public(), PurposeSession, CommandResultMessage(r), sig); !errors.Is(err, ErrSignature) {
		t.Errorf("result signature verified as a session proof: %v", err)
	}
}

// Property: two different results never share a message (the encoding is
// injective), so a signature of one never verifies for the other.
func TestCommandResultMessageInjective(t *testing.T) {
	gen := rapid.Custom(func(t *rapid.T) CommandResult {
		return CommandResult{
			CommandID:          rapid.StringN(0, 8, -1).Draw(t, "cmd"),
			NodeID:             rapid.StringN(0, 8, -1).Draw(t, "node"),
			IdentityGeneration: rapid.Int64Range(0, 3).Draw(t, "gen"),
			OK:                 rapid.Bool().Draw(t, "ok"),
			Output:             rapid.SliceOfN(rapid.Byte(), 0, 4).Draw(t, "out"),
			Error:              rapid.StringN(0, 8, -1).Draw(t, "err"),
		}
	})
	rapid.Check(t, func(t *rapid.T) {
		a, b := gen.Draw(t, "a"), gen.Draw(t, "b")
		same := a.CommandID == b.CommandID && a.NodeID == b.NodeID && a.IdentityGeneration == b.IdentityGeneration &&
			a.OK == b.OK && bytes.Equal(a.Output, b.Output) && a.Error == b.Error
		if eq := bytes.Equal(CommandResultMessage(a), CommandResultMessage(b)); eq != same {
			t.Fatalf("messages equal %v, results equal %v: %+v %+v", eq, same, a, b)
		}
	})
}
