package pki

import (
	"bytes"
	"crypto/ecdh"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"hash"
)

// A session's heartbeat key (R12.1). Verifying an ECDSA signature per
// heartbeat is most of what a held session costs the API in cryptography,
// so a session may agree a symmetric key instead and MAC its heartbeats:
//
//   - bcd offers an ephemeral X25519 public key in Hello, covered by the
//     node key's proof (SessionProofMessage), so no relay can replace or
//     strip it;
//   - the API, when configured to, answers with its own ephemeral X25519
//     public key in Welcome;
//   - both derive K = HKDF-SHA256(X25519 shared secret, salt = the
//     session's nonce, info = HeartbeatKeyLabel || node id ||
//     sha256(certificate DER) || daemon's key || API's key);
//   - each heartbeat carries HMAC-SHA256(K, HeartbeatMACMessage(nonce,
//     seq)), and the API checks it in constant time, with seq strictly
//     rising as for signed heartbeats.
//
// SECURITY, against a compromised gateway (which sees every byte and may
// rewrite the unsigned Welcome): the daemon's key is bound by its node-key
// signature, so the API's side of the exchange is always with the daemon.
// A gateway that replaces the API's key in Welcome makes bcd derive a key
// the gateway knows, but the API derives its own from the daemon's key
// and its own private key, which never leave it: the gateway still cannot
// make a heartbeat the API accepts (the session fails at bcd's first one).
// Replays are refused by seq; another session's MAC fails by its nonce and
// keys. Command results and site reports stay signed by the node key: they
// are records, and must be attributable to the node, not to a key the API
// shares.

// HeartbeatKeySize is the size of an X25519 public key and of the derived
// heartbeat key.
const HeartbeatKeySize = 32

// HeartbeatKeyLabel starts the HKDF info of a session's heartbeat key.
const HeartbeatKeyLabel = "better-compute session heartbeat v1"

// heartbeatMACLabel starts every heartbeat MAC's message.
const heartbeatMACLabel = "heartbeat"

var errHeartbeatKey = errors.New("heartbeat key: not an X25519 public key")

// NewHeartbeatKeyShare returns a fresh ephemeral X25519 key for one
// session: bcd sends its public key in Hello, the API in Welcome.
func NewHeartbeatKeyShare() (*ecdh.PrivateKey, error) {
	return ecdh.X25519().GenerateKey(rand.Reader)
}

// HeartbeatKeyParams is what a session's heartbeat key is bound to.
type HeartbeatKeyParams struct {
	Nonce   []byte // the session's challenge
	NodeID  string
	CertDER []byte // the session's certificate
	// DaemonKey and APIKey are the two X25519 public keys, as Hello and
	// Welcome carry them.
	DaemonKey, APIKey []byte
}

// DeriveHeartbeatKey derives the session's heartbeat key from own (the
// daemon's or the API's ephemeral key) and the other side's public key in
// p. It fails on a key that is not X25519 (or a low-order point), a
// nonce of another size, or when own's public key is neither of p's.
func DeriveHeartbeatKey(own *ecdh.PrivateKey, p HeartbeatKeyParams) ([]byte, error) {
	if len(p.Nonce) != SessionNonceSize {
		return nil, errNonce
	}
	if len(p.DaemonKey) != HeartbeatKeySize || len(p.APIKey) != HeartbeatKeySize {
		return nil, errHeartbeatKey
	}
	mine := own.PublicKey().Bytes()
	var peer []byte
	switch {
	case bytes.Equal(mine, p.DaemonKey):
		peer = p.APIKey
	case bytes.Equal(mine, p.APIKey):
		peer = p.DaemonKey
	default:
		return nil, errors.New("heartbeat key: own key is not one of the session's")
	}
	pub, err := ecdh.X25519().NewPublicKey(peer)
	if err != nil {
		return nil, errHeartbeatKey
	}
	secret, err := own.ECDH(pub) // fails on a low-order point (all-zero secret)
	if err != nil {
		return nil, errHeartbeatKey
	}
	sum := sha256.Sum256(p.CertDER)
	info := make([]byte, 0, len(HeartbeatKeyLabel)+len(p.NodeID)+len(sum)+2*HeartbeatKeySize)
	info = append(info, HeartbeatKeyLabel...)
	info = append(info, p.NodeID...)
	info = append(info, sum[:]...)
	info = append(info, p.DaemonKey...)
	info = append(info, p.APIKey...)
	return hkdf.Key(sha256.New, secret, p.Nonce, string(info), HeartbeatKeySize)
}

// HeartbeatMACMessage is the message of the seq-th heartbeat's MAC on the
// session opened with nonce:
//
//	"heartbeat" || nonce (32 bytes) || seq (8 bytes big-endian)
func HeartbeatMACMessage(nonce []byte, seq uint64) []byte {
	m := make([]byte, 0, len(heartbeatMACLabel)+len(nonce)+8)
	m = append(m, heartbeatMACLabel...)
	m = append(m, nonce...)
	return binary.BigEndian.AppendUint64(m, seq)
}

// HeartbeatMAC is one side's MAC of a session's heartbeats under its
// heartbeat key. It is not safe for concurrent use: each session has its
// own, used by its one sender (bcd) or its one handler (the API).
type HeartbeatMAC struct {
	h     hash.Hash
	nonce []byte
	buf   []byte
	sum   []byte
}

// NewHeartbeatMAC returns the MAC of the session opened with nonce, under
// key (DeriveHeartbeatKey).
func NewHeartbeatMAC(key, nonce []byte) *HeartbeatMAC {
	return &HeartbeatMAC{h: hmac.New(sha256.New, key), nonce: nonce,
		buf: make([]byte, 0, len(heartbeatMACLabel)+SessionNonceSize+8), sum: make([]byte, 0, sha256.Size)}
}

func (m *HeartbeatMAC) compute(seq uint64) []byte {
	m.buf = append(m.buf[:0], heartbeatMACLabel...)
	m.buf = append(m.buf, m.nonce...)
	m.buf = binary.BigEndian.AppendUint64(m.buf, seq)
	m.h.Reset()
	m.h.Write(m.buf)
	return m.h.Sum(m.sum[:0])
}

// Sum returns the seq-th heartbeat's MAC (a new slice).
func (m *HeartbeatMAC) Sum(seq uint64) []byte {
	return bytes.Clone(m.compute(seq))
}

// Verify reports whether mac is the seq-th heartbeat's MAC, in constant
// time (hmac.Equal).
func (m *HeartbeatMAC) Verify(seq uint64, mac []byte) bool {
	return hmac.Equal(m.compute(seq), mac)
}
