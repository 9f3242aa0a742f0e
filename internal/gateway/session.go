package gateway

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/wire"
)

// sessionHandler serves SessionService.Connect: each daemon stream is
// relayed to the API's agent listener as one upstream stream, with the
// daemon's certificate forwarded in Bc-Peer-Certificate (R12.1). Messages
// are bounded by max_body_bytes both ways; when either side ends, the
// other is ended.
//
// SECURITY: the gateway refuses a session without a client certificate
// but does not verify the one presented (it has no node CA and no
// node_certs): the API matches it byte for byte against its records.
// Commands are signed by the control plane and verified by bcd, so the
// gateway can drop or delay them but not forge or alter them.
func (g *Gateway) sessionHandler() (string, http.Handler) {
	path, h := agentv1connect.NewSessionServiceHandler(&sessionRelay{g: g},
		connect.WithReadMaxBytes(g.cfg.MaxBodyBytes),
		connect.WithSendMaxBytes(g.cfg.MaxBodyBytes),
		connect.WithCompressMinBytes(compressMinBytes),
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

// Connect relays one session.
func (r *sessionRelay) Connect(ctx context.Context, down *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	g := r.g
	proc := agentv1connect.SessionServiceConnectProcedure
	p := peerOf(ctx)
	if len(p.certDER) == 0 {
		return wire.ToWire(g.log, proc, errs.New(errs.AccessDenied, "Session refused"))
	}
	select {
	case g.held <- struct{}{}:
	default:
		g.log.Warn("gateway full: session refused", "peer", p.addr, "max_sessions", g.cfg.MaxSessions)
		return wire.ToWire(g.log, proc, errs.New(errs.ResourcesLimited, "the gateway is busy; retry later"))
	}
	defer func() { <-g.held }()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := g.clock.Now()
	up := g.sessions.Connect(ctx)
	up.RequestHeader().Set(HeaderPeerAddr, p.addr)
	up.RequestHeader().Set(HeaderPeerCertificate, base64.StdEncoding.EncodeToString(p.certDER))

	// daemon -> API. When the daemon ends its side, so does the relay.
	go func() {
		defer func() { _ = up.CloseRequest() }()
		for {
			m, err := down.Receive()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					// The daemon vanished: end the upstream stream too.
					cancel()
				}
				return
			}
			if err := up.Send(m); err != nil {
				return
			}
		}
	}()
	// API -> daemon.
	for {
		m, err := up.Receive()
		if err != nil {
			_ = up.CloseResponse()
			if errors.Is(err, io.EOF) || ctx.Err() != nil {
				return nil
			}
			return g.upstreamError(proc, p, start, err)
		}
		if err := down.Send(m); err != nil {
			return nil
		}
	}
}
