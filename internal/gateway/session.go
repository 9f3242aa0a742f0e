package gateway

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// sessionHandler serves SessionService.Connect: each daemon stream is
// relayed to the API's agent listener as one upstream stream, with the
// daemon's certificate forwarded in Bc-Peer-Certificate (R12.1). Messages
// are bounded by max_body_bytes both ways; when either side ends, the
// other is ended.
//
// The API speaks first: its Challenge (a nonce) goes down to the daemon,
// whose Hello (signed over the nonce by the node key) comes back up, then
// Welcome. The relay opens the upstream stream at once (Send(nil)) so the
// Challenge can flow before the daemon has sent anything.
//
// SECURITY: the gateway refuses a session without a client certificate
// but does not verify the one presented (it has no node CA and no
// node_certs): the API matches it byte for byte against its records and
// requires the node key's signature over its nonce, so a relay holding
// only the certificate cannot open the node's session. Commands are signed
// by the control plane and verified by bcd, and results are signed by the
// node key and verified by the API, so the gateway can drop or delay them
// but not forge or alter them. It does refuse a command whose kind the
// certificate does not allow (R7.5, the check at dispatch): the API names
// the allowed kinds in Welcome, and accepts the gateway's unsigned
// refusal (wire.GatewayKindRefused) only for such a kind.
func (g *Gateway) sessionHandler() (string, http.Handler) {
	path, h := agentv1connect.NewSessionServiceHandler(&sessionRelay{g: g},
		connect.WithReadMaxBytes(g.cfg.MaxBodyBytes),
		connect.WithSendMaxBytes(g.cfg.MaxBodyBytes),
		noCompression,
	)
	return path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// A session outlives the server's per-request timeouts by design.
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Time{})
		_ = rc.SetWriteDeadline(time.Time{})
		h.ServeHTTP(w, r)
	})
}

type sessionRelay struct {
	agentv1connect.UnimplementedSessionServiceHandler
	g *Gateway
}

// Connect relays one session. Two goroutines per session: the handler's
// (API -> daemon, where commands are checked) and one for daemon -> API,
// one of the gateway's tasks (it ends once the handler returned: net/http
// then ends the daemon's stream).
func (r *sessionRelay) Connect(ctx context.Context, down *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	g := r.g
	proc := agentv1connect.SessionServiceConnectProcedure
	p := peerOf(ctx)
	if len(p.certDER) == 0 {
		return wire.ToWireContext(ctx, g.log, proc, errs.New(errs.AccessDenied, "Session refused"))
	}
	select {
	case g.held <- struct{}{}:
	default:
		g.lines.LogContext(ctx, slog.LevelWarn, "full", "gateway full: session refused", telemetry.LogPeer, p.addr, "max_sessions", g.cfg.MaxSessions)
		return wire.ToWireContext(ctx, g.log, proc, errs.New(errs.ResourcesLimited, "the gateway is busy; retry later"))
	}
	defer func() { <-g.held }()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Shutdown ends the session.
	defer context.AfterFunc(g.stopped, cancel)()
	start := g.clock.Now()
	// A new session goes to a healthy replica; one whose replica dies
	// ends, and bcd reconnects (to another replica through pick).
	u := g.pick(nil)
	up := u.session().Connect(ctx)
	up.RequestHeader().Set(wire.PeerAddrHeader, p.addr)
	wire.SetPeerCertificate(up.RequestHeader(), p.certDER)
	// Open the upstream stream now: the API's Challenge comes first, before
	// the daemon sends anything.
	if err := up.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		g.relayError(u)
		g.markDown(u, err)
		return g.upstreamError(ctx, proc, p, start, err)
	}
	g.metrics.opened.Inc()
	// up.Send is used by both goroutines (relayed messages; results of
	// refused commands).
	var sendMu sync.Mutex
	send := func(m *agentv1.SessionClientMessage) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return up.Send(m)
	}
	// Canceling the stream's context does not end it while its request
	// body is open (net/http watches the context only once the body is
	// written), so the end of the session closes the request body too; the
	// transport then resets the stream and the API sees the end at once.
	// CloseRequest is safe alongside a Send (it closes a pipe).
	stopUp := context.AfterFunc(ctx, func() { _ = up.CloseRequest() })
	defer func() {
		cancel()
		stopUp()
		_ = up.CloseRequest()  // again, harmless: the pipe closes once
		_ = up.CloseResponse() // drains what is left: needs the stream ended
	}()

	// daemon -> API. When the daemon ends its side, so does the relay.
	if !g.tasks.Go(func() { relayUp(down, up, &sendMu, send, cancel) }) {
		return wire.ToWireContext(ctx, g.log, proc, errs.New(errs.Unavailable, "the gateway is shutting down; reconnect"))
	}
	// API -> daemon.
	var (
		welcomed bool
		allowed  []string
		nodeID   string
	)
	for {
		m, err := up.Receive()
		if err != nil {
			var ce *connect.Error
			switch {
			case g.stopped.Err() != nil:
				return wire.ToWireContext(ctx, g.log, proc, errs.New(errs.Unavailable, "the gateway is shutting down; reconnect"))
			case errors.Is(err, io.EOF):
				return nil
			case errors.As(err, &ce) && connect.IsWireError(ce):
				// The API's answer (a refusal) goes to the daemon as it is.
				return g.upstreamError(ctx, proc, p, start, err)
			case ctx.Err() != nil:
				return nil // the daemon left
			}
			g.relayError(u)
			return g.upstreamError(ctx, proc, p, start, err)
		}
		switch msg := m.GetMsg().(type) {
		case *agentv1.SessionServerMessage_Welcome:
			if !welcomed {
				welcomed = true
				allowed = msg.Welcome.GetAllowedKinds()
				nodeID = msg.Welcome.GetNodeId()
			}
		case *agentv1.SessionServerMessage_Command:
			if id, kind, ok := g.commandAllowed(allowed, msg.Command); !ok {
				g.log.WarnContext(ctx, "command refused at the gateway: kind not allowed by the node certificate",
					telemetry.LogNodeID, nodeID, telemetry.LogPeer, p.addr, telemetry.LogCommand, id, telemetry.LogKind, kind, "allowed_kinds", strings.Join(allowed, ","))
				if id != "" {
					if err := send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: &agentv1.CommandResult{
						CommandId: id, Ok: false, Error: wire.GatewayKindRefused}}}); err != nil {
						return nil
					}
				}
				continue
			}
		}
		if err := down.Send(m); err != nil {
			return nil
		}
	}
}

// relayUp relays a session's daemon -> API direction until either side
// ends: the daemon's end of its side closes the upstream request; the
// daemon vanishing ends the whole session.
func relayUp(down *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage],
	up *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage],
	sendMu *sync.Mutex, send func(*agentv1.SessionClientMessage) error, cancel context.CancelFunc) {
	for {
		m, err := down.Receive()
		if err != nil {
			if errors.Is(err, io.EOF) {
				sendMu.Lock()
				_ = up.CloseRequest()
				sendMu.Unlock()
			} else {
				// The daemon vanished: end the upstream stream too.
				cancel()
			}
			return
		}
		if err := send(m); err != nil {
			// The upstream stream ended; the handler's Receive sees how
			// (the API's refusal, say) and tells the daemon.
			return
		}
	}
}

// commandAllowed parses the command's body (bounded: the whole message is
// at most max_body_bytes) and checks its kind against allowed. The
// signature is bcd's to verify; a body that does not parse is refused too.
func (g *Gateway) commandAllowed(allowed []string, c *agentv1.SignedCommand) (id, kind string, ok bool) {
	if len(allowed) == 0 {
		return "", "", true
	}
	var body agentv1.CommandBody
	if len(c.GetBody()) > g.cfg.MaxBodyBytes || proto.Unmarshal(c.GetBody(), &body) != nil {
		return "", "", false
	}
	return body.GetCommandId(), body.GetKind(), wire.KindAllowed(allowed, body.GetKind())
}
