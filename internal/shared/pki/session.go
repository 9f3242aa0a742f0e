package pki

import (
	"crypto"
	"crypto/sha256"
	"encoding/binary"
	"errors"
)

// Signature purposes of node sessions (R12.1, R12.3).
const (
	// PurposeSession is a node's proof of possession at the start of a
	// session: its signature over the API's nonce.
	PurposeSession = "session"
	// PurposeCommandResult signs a node's answer to a command.
	PurposeCommandResult = "command-result"
	// PurposeHeartbeat signs a node's heartbeats on a session.
	PurposeHeartbeat = "session-heartbeat"
)

// SessionNonceSize is the size of the API's session challenge.
const SessionNonceSize = 32

// errNonce is returned for a nonce of another size.
var errNonce = errors.New("session proof: the nonce must be 32 bytes")

// SessionProofMessage is the message a node signs, under purpose session,
// to open a session (R12.1):
//
//	nonce (32 bytes) || node id (UTF-8) || sha256(certificate DER) (32 bytes)
//	  [ || heartbeat key (the daemon's X25519 public key, 32 bytes) ]
//
// The nonce and the hash have fixed lengths, so the node id between them is
// unambiguous. The certificate is the one the node presented on its TLS
// connection (the one the gateway forwards), so a proof made for one
// certificate never opens a session with another. The heartbeat key, when
// the daemon offers one (Hello.heartbeat_key), is covered too: a relay can
// neither put its own key in its place nor strip it (the message without
// it is another message, 32 bytes shorter, and the proof no longer
// verifies). bcd (signing) and the session service (verifying) both build
// it here. It returns nil for a nonce of another size.
func SessionProofMessage(nonce []byte, nodeID string, certDER, heartbeatKey []byte) []byte {
	if len(nonce) != SessionNonceSize {
		return nil
	}
	sum := sha256.Sum256(certDER)
	m := make([]byte, 0, len(nonce)+len(nodeID)+len(sum)+len(heartbeatKey))
	m = append(m, nonce...)
	m = append(m, nodeID...)
	m = append(m, sum[:]...)
	return append(m, heartbeatKey...)
}

// SignSessionProof signs a session proof with the node key, binding the
// daemon's heartbeat key when it offers one (nil: none).
func SignSessionProof(key crypto.Signer, nonce []byte, nodeID string, certDER, heartbeatKey []byte) ([]byte, error) {
	m := SessionProofMessage(nonce, nodeID, certDER, heartbeatKey)
	if m == nil {
		return nil, errNonce
	}
	return SignPurpose(key, PurposeSession, m)
}

// VerifySessionProof checks a SignSessionProof signature under pub, the
// key of the certificate certDER, over heartbeatKey as Hello carries it.
func VerifySessionProof(pub crypto.PublicKey, nonce []byte, nodeID string, certDER, heartbeatKey, sig []byte) error {
	m := SessionProofMessage(nonce, nodeID, certDER, heartbeatKey)
	if m == nil {
		return errNonce
	}
	return VerifyPurpose(pub, PurposeSession, m, sig)
}

// HeartbeatMessage is the message a node signs, under purpose
// session-heartbeat, for the seq-th heartbeat of the session opened with
// nonce:
//
//	nonce (32 bytes) || seq (8 bytes big-endian)
//
// The nonce ties it to one session, the sequence number to one place in
// it, so a heartbeat cannot be replayed on another session or again on the
// same one. It returns nil for a nonce of another size.
func HeartbeatMessage(nonce []byte, seq uint64) []byte {
	if len(nonce) != SessionNonceSize {
		return nil
	}
	m := make([]byte, 0, len(nonce)+8)
	m = append(m, nonce...)
	return binary.BigEndian.AppendUint64(m, seq)
}

// SignHeartbeat signs a heartbeat with the node key.
func SignHeartbeat(key crypto.Signer, nonce []byte, seq uint64) ([]byte, error) {
	m := HeartbeatMessage(nonce, seq)
	if m == nil {
		return nil, errNonce
	}
	return SignPurpose(key, PurposeHeartbeat, m)
}

// VerifyHeartbeat checks a SignHeartbeat signature under pub.
func VerifyHeartbeat(pub crypto.PublicKey, nonce []byte, seq uint64, sig []byte) error {
	m := HeartbeatMessage(nonce, seq)
	if m == nil {
		return errNonce
	}
	return VerifyPurpose(pub, PurposeHeartbeat, m, sig)
}

// CommandResult is what a node's signed answer to a command covers.
type CommandResult struct {
	CommandID string
	NodeID    string
	// IdentityGeneration is the generation the command was issued for, as
	// the node read it from the signed command body.
	IdentityGeneration int64
	OK                 bool
	Output             []byte
	Error              string
}

// CommandResultMessage is the message a node signs, under purpose
// command-result, over its answer to a command (R12.3):
//
//	len(command id) (4 bytes) || command id || len(node id) (4 bytes) || node id ||
//	identity generation (8 bytes) || ok (1 byte: 0 or 1) || sha256(output) (32 bytes) ||
//	len(error) (4 bytes) || error
//
// Lengths are big-endian. Every variable field is length-prefixed, so no
// two results share a message. bcd (signing) and the session service
// (verifying) both build it here.
func CommandResultMessage(r CommandResult) []byte {
	sum := sha256.Sum256(r.Output)
	m := make([]byte, 0, 4+len(r.CommandID)+4+len(r.NodeID)+8+1+len(sum)+4+len(r.Error))
	m = binary.BigEndian.AppendUint32(m, uint32(len(r.CommandID)))
	m = append(m, r.CommandID...)
	m = binary.BigEndian.AppendUint32(m, uint32(len(r.NodeID)))
	m = append(m, r.NodeID...)
	m = binary.BigEndian.AppendUint64(m, uint64(r.IdentityGeneration))
	ok := byte(0)
	if r.OK {
		ok = 1
	}
	m = append(m, ok)
	m = append(m, sum[:]...)
	m = binary.BigEndian.AppendUint32(m, uint32(len(r.Error)))
	return append(m, r.Error...)
}

// SignCommandResult signs a command result with the node key.
func SignCommandResult(key crypto.Signer, r CommandResult) ([]byte, error) {
	return SignPurpose(key, PurposeCommandResult, CommandResultMessage(r))
}

// VerifyCommandResult checks a SignCommandResult signature under pub, the
// key of the session's certificate.
func VerifyCommandResult(pub crypto.PublicKey, r CommandResult, sig []byte) error {
	return VerifyPurpose(pub, PurposeCommandResult, CommandResultMessage(r), sig)
}

// PurposeSiteReport signs a site agent's report of the machines it booted
// (R10.4).
const PurposeSiteReport = "site-report"

// SiteReportMessage is the message a site agent signs, under purpose
// site-report, for a report body on the session opened with nonce:
//
//	nonce (32 bytes) || sha256(body)
//
// The nonce ties the report to one session (the body's sequence number to
// one place in it). It returns nil for a nonce of another size.
func SiteReportMessage(nonce, body []byte) []byte {
	if len(nonce) != SessionNonceSize {
		return nil
	}
	sum := sha256.Sum256(body)
	return append(append(make([]byte, 0, len(nonce)+len(sum)), nonce...), sum[:]...)
}

// SignSiteReport signs a site report body with the site agent's node key.
func SignSiteReport(key crypto.Signer, nonce, body []byte) ([]byte, error) {
	m := SiteReportMessage(nonce, body)
	if m == nil {
		return nil, errNonce
	}
	return SignPurpose(key, PurposeSiteReport, m)
}

// VerifySiteReport checks a SignSiteReport signature under pub.
func VerifySiteReport(pub crypto.PublicKey, nonce, body, sig []byte) error {
	m := SiteReportMessage(nonce, body)
	if m == nil {
		return errNonce
	}
	return VerifyPurpose(pub, PurposeSiteReport, m, sig)
}

// PurposePinsAck signs the pins a node says it holds, in its session's
// Hello (R21.2).
const PurposePinsAck = "session-pins"

// MaxAckedPins bounds the pins a Hello may acknowledge: a few of each
// pinned kind while they rotate.
const MaxAckedPins = 16

// PinsAckMessage is the message a node signs, under purpose session-pins,
// to tell the control plane which pins it holds at the start of the
// session opened with nonce (R21.2):
//
//	nonce (32 bytes) || sha256(pin 1 || "\n" || pin 2 || "\n" || …)
//
// The nonce ties it to this session, so a relay can neither replay an
// older acknowledgement nor rewrite the pins (pki status would count a
// node as up to date that is not). It returns nil for a nonce of another
// size.
func PinsAckMessage(nonce []byte, pins []string) []byte {
	if len(nonce) != SessionNonceSize {
		return nil
	}
	h := sha256.New()
	for _, p := range pins {
		h.Write([]byte(p))
		h.Write([]byte{'\n'})
	}
	return h.Sum(append([]byte(nil), nonce...))
}

// SignPinsAck signs the pins a node holds for the session opened with
// nonce.
func SignPinsAck(key crypto.Signer, nonce []byte, pins []string) ([]byte, error) {
	m := PinsAckMessage(nonce, pins)
	if m == nil {
		return nil, errNonce
	}
	return SignPurpose(key, PurposePinsAck, m)
}

// VerifyPinsAck checks a SignPinsAck signature under pub, the node key of
// the session, and that every pin is one.
func VerifyPinsAck(pub crypto.PublicKey, nonce []byte, pins []string, sig []byte) error {
	if len(pins) == 0 || len(pins) > MaxAckedPins {
		return errors.New("pins acknowledgement: no pins, or too many")
	}
	for _, p := range pins {
		if !ValidPin(p) {
			return errors.New("pins acknowledgement: not a pin")
		}
	}
	m := PinsAckMessage(nonce, pins)
	if m == nil {
		return errNonce
	}
	return VerifyPurpose(pub, PurposePinsAck, m, sig)
}
