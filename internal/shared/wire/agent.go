package wire

import (
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// The agent protocol's constants that more than one side reads: bcd, the
// gateway, the API's session service, the command queue and the
// controllers all refer to these, never to a copy.

// Command kinds bcd runs built in.
const (
	KindNodeFacts       = "node.facts"
	KindAcceptanceCheck = "acceptance.check"
)

// BuiltInKind reports whether bcd runs kind built in.
func BuiltInKind(kind string) bool {
	return kind == KindNodeFacts || kind == KindAcceptanceCheck
}

// PeerHeaderPrefix starts every header the gateway owns (PeerAddrHeader,
// PeerCertificateHeader): the gateway drops any such header a daemon sent.
const PeerHeaderPrefix = "Bc-Peer-"

// GatewayKindRefused is the error of the CommandResult the gateway sends
// the API, unsigned, for a command whose kind the session's certificate
// does not allow (R7.5, the check at dispatch). It is the only unsigned
// result the API accepts, and only as a failure without output: a relay
// can refuse a command (it could drop it anyway), never answer one.
const GatewayKindRefused = "kind not allowed at the gateway"

// NodeRetiredMessage is the error (INVALID_STATE) that ends the session of
// a retired node once the node proved possession of its key: bcd stops
// instead of reconnecting (R12.1).
const NodeRetiredMessage = "This node was retired"

// ErrNodeRetired is the product error behind NodeRetiredMessage.
func ErrNodeRetired() *errs.E { return errs.New(errs.InvalidState, NodeRetiredMessage) }

// IsNodeRetired reports whether err (a wire error or a product error) says
// the node was retired.
func IsNodeRetired(err error) bool {
	if err == nil {
		return false
	}
	e, ok := errs.As(err)
	if !ok {
		e, ok = errs.As(FromWire(err))
	}
	return ok && e.Code == errs.InvalidState && e.Message == NodeRetiredMessage
}
