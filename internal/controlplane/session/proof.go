package session

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/x509"
	"fmt"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Refusal reasons of the checks in this file.
const (
	// reasonSessionProof: Hello carries no valid signature by the
	// certificate's key over the session's nonce.
	reasonSessionProof = "session-proof"
	// reasonResultSignature: a command result does not verify under the
	// session's certificate.
	reasonResultSignature = "result-signature"
	// reasonHeartbeatSignature: a heartbeat is not signed by the session's
	// key over its nonce, or repeats an earlier sequence number.
	reasonHeartbeatSignature = "heartbeat-signature"
	// reasonHeartbeatMAC: on a session that agreed a heartbeat key, a
	// heartbeat without a valid MAC under it, or repeating an earlier
	// sequence number.
	reasonHeartbeatMAC = "heartbeat-mac"
	// reasonHeartbeatKey: the heartbeat key the daemon offered (and
	// signed) is not an X25519 public key.
	reasonHeartbeatKey = "heartbeat-key"
)

// challenge sends the session's Challenge: a fresh nonce from crypto/rand
// that the daemon must sign with its node key in Hello (R12.1).
func (s *Service) challenge(send func(*agentv1.SessionServerMessage) error) ([]byte, error) {
	nonce := make([]byte, pki.SessionNonceSize)
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("make the session nonce: %w", err)
	}
	if err := send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: nonce}}}); err != nil {
		return nil, err
	}
	return nonce, nil
}

// checkProof verifies Hello's proof of possession: the signature by the
// key of certificate der (which authenticate matched byte for byte to the
// node's record) over pki.SessionProofMessage(nonce, node, der, the
// heartbeat key Hello offers, if any). It returns
// the certificate, or a refusal reason.
//
// SECURITY: the certificate is public and the gateway that forwards it is
// not trusted; only this signature shows that the node's key is on the
// other end of the stream. The nonce is this stream's own, so a proof
// captured from another session does not verify.
func checkProof(der []byte, nodeID string, nonce []byte, hello *agentv1.Hello) (*x509.Certificate, string) {
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, reasonSessionProof
	}
	if len(hello.GetProof()) == 0 || pki.VerifySessionProof(leaf.PublicKey, nonce, nodeID, der, hello.GetHeartbeatKey(), hello.GetProof()) != nil {
		return nil, reasonSessionProof
	}
	return leaf, ""
}

// agreeHeartbeatKey agrees the session's heartbeat key with a daemon that
// offered one in Hello (after checkProof verified Hello, its key
// included): it returns the MAC its heartbeats are checked with and the
// API's ephemeral public key for Welcome, or nils for a daemon that
// offered none (its heartbeats stay signed), or a refusal reason.
//
// SECURITY: the daemon's key is bound by its node-key proof, so a relay
// can neither replace it nor strip it (the proof would not verify). The
// API's key goes out unsigned in Welcome: a relay that replaces it makes
// the daemon derive a key the relay knows, but this side's key is derived
// from this side's private key, which never leaves this process, so the
// relay still cannot make a heartbeat it accepts (the session ends at the
// daemon's first heartbeat). The private key is dropped when this returns.
func agreeHeartbeatKey(der []byte, nodeID string, nonce []byte, hello *agentv1.Hello) (*pki.HeartbeatMAC, []byte, string) {
	daemonKey := hello.GetHeartbeatKey()
	if len(daemonKey) == 0 {
		return nil, nil, ""
	}
	own, err := pki.NewHeartbeatKeyShare()
	if err != nil {
		return nil, nil, reasonHeartbeatKey
	}
	apiKey := own.PublicKey().Bytes()
	k, err := pki.DeriveHeartbeatKey(own, pki.HeartbeatKeyParams{Nonce: nonce, NodeID: nodeID, CertDER: der, DaemonKey: daemonKey, APIKey: apiKey})
	if err != nil {
		return nil, nil, reasonHeartbeatKey
	}
	return pki.NewHeartbeatMAC(k, nonce), apiKey, ""
}

// retiredWithProof reports whether der is a certificate issued to a node
// that is now retired, and the other end proves it holds that
// certificate's key (Challenge, then Hello's proof). Such a daemon is told
// that its node was retired, so it stops instead of reconnecting forever;
// anyone else, a relay holding only the certificate included, learns
// nothing beyond the uniform refusal. It is asked only after
// authenticate refused, and never changes the refusal that is recorded.
func (s *Service) retiredWithProof(ctx context.Context, stream *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage], der []byte) bool {
	nodeID, ok := s.retiredNode(ctx, der)
	if !ok {
		return false
	}
	nonce, err := s.challenge(stream.Send)
	if err != nil {
		return false
	}
	hello, err := s.receiveHello(ctx, stream)
	if err != nil {
		return false
	}
	_, reason := checkProof(der, nodeID, nonce, hello)
	return reason == ""
}

// retiredNode returns the node certificate der was issued to, when it is
// a recorded certificate of that node and the node is retired: the first
// half of retiredWithProof, before the Challenge.
func (s *Service) retiredNode(ctx context.Context, der []byte) (string, bool) {
	if len(der) == 0 {
		return "", false
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return "", false
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil {
		return "", false
	}
	retired := false
	err = s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		row, err := tx.GetNodeCert(ctx, pki.SerialHex(leaf))
		if err != nil || !bytes.Equal(row.DER, der) || row.NodeID != id.NodeID {
			return err
		}
		n, err := tx.GetNode(ctx, row.NodeID)
		if err != nil {
			return err
		}
		retired = n.State == store.NodeRetired
		return nil
	})
	if err != nil || !retired {
		return "", false
	}
	return id.NodeID, true
}

// checkResult checks a command result's signature (R12.3): by the key of
// the session's certificate over pki.CommandResultMessage, for this node
// and the command's identity generation. It returns a refusal reason, or
// "" when the result may be stored.
//
// The one unsigned result accepted is the gateway's refusal of a kind the
// session's certificate does not allow (R7.5: the gateway checks again at
// dispatch): a failure with wire.GatewayKindRefused and no output. For a
// kind the certificate allows it is a forgery like any other: a relay can
// drop a command, never answer it.
func checkResult(c *conn, cmd store.Command, r *agentv1.CommandResult) string {
	if len(r.GetSig()) == 0 && !r.GetOk() && len(r.GetOutput()) == 0 && r.GetError() == wire.GatewayKindRefused &&
		!wire.KindAllowed(c.allowedKinds, cmd.Kind) {
		return ""
	}
	err := pki.VerifyCommandResult(c.nodeKey, pki.CommandResult{
		CommandID: cmd.ID, NodeID: c.nodeID, IdentityGeneration: int64(cmd.IdentityGeneration),
		OK: r.GetOk(), Output: r.GetOutput(), Error: r.GetError(),
	}, r.GetSig())
	if err != nil {
		return reasonResultSignature
	}
	return ""
}

// checkHeartbeat checks a heartbeat and a sequence number above the last
// one (a relay can neither make heartbeats nor replay the node's), and
// returns a refusal reason or "": on a session that agreed a heartbeat key
// its MAC under that key (in constant time; a signature does not do
// instead, so a relay that strips the API's key from Welcome only ends
// the session), else its signature by the session's key over its nonce.
// Only verified heartbeats keep a session from ending idle, so a session
// ends when its daemon is gone, whatever the relay sends.
func checkHeartbeat(c *conn, hb *agentv1.Heartbeat) string {
	if c.mac != nil {
		if hb.GetSeq() <= c.lastSeq || !c.mac.Verify(hb.GetSeq(), hb.GetMac()) {
			return reasonHeartbeatMAC
		}
	} else if hb.GetSeq() <= c.lastSeq || pki.VerifyHeartbeat(c.nodeKey, c.nonce, hb.GetSeq(), hb.GetSig()) != nil {
		return reasonHeartbeatSignature
	}
	c.lastSeq = hb.GetSeq()
	return ""
}
