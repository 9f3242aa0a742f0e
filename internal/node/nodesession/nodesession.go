// Package nodesession is bcd's side of the session protocol (R12.1) that
// bcd run (internal/node/run) and the load generator's lean holder
// (internal/tools/loadgen) share, so both speak it from one source: the
// Hello that answers the API's Challenge (the node key's proof over the
// nonce, the certificate and the ephemeral heartbeat key bcd always
// offers, and the pins it holds), the heartbeats that follow Welcome
// (MAC'd under the key agreed with the API when Welcome carries the API's
// share, else signed by the node key), the signature over a command's
// result, and the waits before a reconnect (R19.3).
//
// It holds no connection and starts nothing: the callers carry the
// messages over their own streams.
package nodesession

import (
	"crypto"
	"crypto/ecdh"
	"errors"
	"fmt"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// Session timing shared by every daemon.
const (
	// MinBackoff and MaxBackoff bound the reconnect backoff.
	MinBackoff = time.Second
	MaxBackoff = 60 * time.Second
	// FirstReconnectSpread is the window the first reconnect after a
	// failure is drawn from, so a fleet that lost its gateway or API at
	// once does not come back at once.
	FirstReconnectSpread = 10 * time.Second
	// StableAfter: a session that lasted this long resets the backoff.
	StableAfter = 30 * time.Second
	// DefaultHeartbeat is the heartbeat interval when Welcome names none.
	DefaultHeartbeat = 15 * time.Second
)

// ReconnectWait is the wait before reconnect attempt n after failures,
// for r in [0, 1): the first is r × FirstReconnectSpread, the others the
// backoff (MinBackoff doubling to MaxBackoff) spread over ±20% by r.
func ReconnectWait(n int, r float64) time.Duration {
	if n <= 1 {
		return time.Duration(min(max(r, 0), 1) * float64(FirstReconnectSpread))
	}
	return backoff.Policy{Min: MinBackoff, Max: MaxBackoff, Jitter: backoff.DefaultJitter}.Spread(n, r)
}

// ErrNoChallenge is Answer's error for a nonce that is not the API's
// Challenge (missing, or of the wrong size).
var ErrNoChallenge = errors.New("no session challenge")

// Opening is one session's opening on bcd's side, between the Hello it
// sent and the Welcome it awaits: the heartbeat key share it offered.
type Opening struct {
	signer  crypto.Signer
	nodeID  string
	certDER []byte
	nonce   []byte
	share   *ecdh.PrivateKey
	offer   []byte
}

// Answer answers the API's Challenge nonce for the node nodeID whose
// certificate (DER) the session's TLS connection presents: a fresh
// heartbeat key share, the proof by the node key over the nonce, the
// certificate and that share (a relay can neither replace nor strip it),
// and the pins held, acknowledged by the node key over the nonce (R21.2).
// It returns the opening, for Welcome, and the Hello to send.
func Answer(signer crypto.Signer, nodeID string, certDER, nonce []byte, pins []string) (*Opening, *agentv1.Hello, error) {
	if len(nonce) != pki.SessionNonceSize {
		return nil, nil, ErrNoChallenge
	}
	share, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		return nil, nil, fmt.Errorf("make the heartbeat key: %w", err)
	}
	offer := share.PublicKey().Bytes()
	proof, err := pki.SignSessionProof(signer, nonce, nodeID, certDER, offer)
	if err != nil {
		return nil, nil, fmt.Errorf("sign the session proof: %w", err)
	}
	pinsSig, err := pki.SignPinsAck(signer, nonce, pins)
	if err != nil {
		return nil, nil, fmt.Errorf("sign the pins acknowledgement: %w", err)
	}
	o := &Opening{signer: signer, nodeID: nodeID, certDER: certDER, nonce: nonce, share: share, offer: offer}
	return o, &agentv1.Hello{Protocol: version.ProtocolMax, BcdVersion: version.Version, Proof: proof, Pins: pins, PinsSig: pinsSig, HeartbeatKey: offer}, nil
}

// Welcomed returns the session's heartbeats after the API's Welcome w
// (whose node id the caller checked) and the interval it names
// (DefaultHeartbeat when none). When w carries the API's heartbeat key
// share, the heartbeats are MAC'd under the key both derive; the error is
// then that share's (a relay's key, or garbage). Welcome is not signed: a
// relay that put its own share there shares a key with this daemon, not
// with the API, and the API ends the session at the first heartbeat.
func (o *Opening) Welcomed(w *agentv1.Welcome) (*Beats, time.Duration, error) {
	b := &Beats{signer: o.signer, nonce: o.nonce}
	if k := w.GetHeartbeatKey(); len(k) > 0 {
		key, err := pki.DeriveHeartbeatKey(o.share, pki.HeartbeatKeyParams{Nonce: o.nonce, NodeID: o.nodeID, CertDER: o.certDER, DaemonKey: o.offer, APIKey: k})
		if err != nil {
			return nil, 0, err
		}
		b.mac = pki.NewHeartbeatMAC(key, o.nonce)
	}
	beat := time.Duration(w.GetHeartbeatSeconds()) * time.Second
	if beat <= 0 {
		beat = DefaultHeartbeat
	}
	return b, beat, nil
}

// Beats makes a session's heartbeats: MAC'd under the session's heartbeat
// key when the API agreed one, else signed by the node key; either way
// over the session's nonce and the heartbeat's sequence number.
type Beats struct {
	signer crypto.Signer
	nonce  []byte
	mac    *pki.HeartbeatMAC // nil: signed
}

// Make returns the seq-th heartbeat.
func (b *Beats) Make(seq uint64) (*agentv1.Heartbeat, error) {
	if b.mac != nil {
		return &agentv1.Heartbeat{Seq: seq, Mac: b.mac.Sum(seq)}, nil
	}
	sig, err := pki.SignHeartbeat(b.signer, b.nonce, seq)
	if err != nil {
		return nil, err
	}
	return &agentv1.Heartbeat{Seq: seq, Sig: sig}, nil
}

// Nonce is the session's nonce (what its other signed messages cover).
func (b *Beats) Nonce() []byte { return b.nonce }

// MACd reports whether the heartbeats are MAC'd rather than signed.
func (b *Beats) MACd() bool { return b.mac != nil }

// SignResult signs a command's result res with the node key: the
// command's id, the node, the identity generation the command named, ok,
// the output's hash and the error (pki.CommandResultMessage). It returns
// the result to send.
func SignResult(signer crypto.Signer, nodeID string, generation int64, res *agentv1.CommandResult) (*agentv1.CommandResult, error) {
	sig, err := pki.SignCommandResult(signer, pki.CommandResult{CommandID: res.GetCommandId(), NodeID: nodeID, IdentityGeneration: generation,
		OK: res.GetOk(), Output: res.GetOutput(), Error: res.GetError()})
	if err != nil {
		return nil, err
	}
	return &agentv1.CommandResult{CommandId: res.GetCommandId(), Ok: res.GetOk(), Output: res.GetOutput(), Error: res.GetError(), Sig: sig}, nil
}
