package enrolltest

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"net/http"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Sessions is the fake SessionService, for the tests of `bcd run`'s
// command line: it sends the Challenge, reads Hello (which must carry a
// proof) and then answers as the node's state says. It checks no
// signature (the session service's tests do).
type Sessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	// Retired makes every session end with the API's "This node was
	// retired" after Hello.
	Retired bool
	// rotation is the JoinService's: a Welcome carries its statements.
	rotation *rotation
}

// Connect serves one session.
func (f *Sessions) Connect(ctx context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	nonce := make([]byte, pki.SessionNonceSize)
	_, _ = rand.Read(nonce)
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: nonce}}}); err != nil {
		return nil
	}
	m, err := s.Receive()
	if err != nil || len(m.GetHello().GetProof()) == 0 {
		return wire.ToWire(discard, "Connect", errs.New(errs.AccessDenied, "Session refused"))
	}
	if f.Retired {
		return wire.ToWire(discard, "Connect", wire.ErrNodeRetired())
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{NodeId: peerNode(ctx), HeartbeatSeconds: 15, KeyStatements: f.rotation.statements()}}}); err != nil {
		return nil
	}
	for {
		if _, err := s.Receive(); err != nil {
			return nil
		}
	}
}

// peerKey carries the TLS state of a session's connection in its context.
type peerKey struct{}

// withPeer puts the request's TLS state into its context, for peerNode.
func withPeer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), peerKey{}, r.TLS)))
	})
}

// peerNode is the node id of the certificate the session's client
// presented, "" without one. The fake checks no signature.
func peerNode(ctx context.Context) string {
	cs, _ := ctx.Value(peerKey{}).(*tls.ConnectionState)
	if cs == nil || len(cs.PeerCertificates) == 0 {
		return ""
	}
	id, err := pki.NodeIdentityOf(cs.PeerCertificates[0])
	if err != nil {
		return ""
	}
	return id.NodeID
}
