package api

import (
	"context"
	"net/http"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// agent serves JoinService to gateways.
type agent struct{ s *Server }

// Join relays to JoinService.Join. The daemon's address, as the gateway
// forwarded it, also goes into the context so that the log line of a
// refusal names it (nodeident.WithPeer).
func (a *agent) Join(ctx context.Context, req *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
	addr := req.Header().Get(wire.PeerAddrHeader)
	res, err := a.s.join.Join(nodeident.WithPeer(ctx, addr), req.Msg, join.Peer{Addr: addr})
	if err != nil {
		return nil, err
	}
	if len(res.GetBody()) > 0 {
		// R21.1: the chain to the key that signed it, for a daemon whose
		// pins predate a rotation (a stored answer may be shared, so it is
		// copied, not changed).
		res = &agentv1.JoinResponse{Body: res.GetBody(), Sig: res.GetSig(), SigningCertificate: res.GetSigningCertificate(), KeyStatements: a.statements()}
	}
	return connect.NewResponse(res), nil
}

// Renew relays to JoinService.Renew with the daemon's TLS client
// certificate as the gateway forwarded it (wire.PeerCertificateHeader).
func (a *agent) Renew(ctx context.Context, req *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
	addr := req.Header().Get(wire.PeerAddrHeader)
	res, err := a.s.join.Renew(nodeident.WithPeer(ctx, addr), req.Msg, join.Peer{Addr: addr, Cert: wire.PeerCertificate(req.Header())})
	if err != nil {
		return nil, err
	}
	res.KeyStatements = a.statements()
	return connect.NewResponse(res), nil
}

// statements are the rotation statements in force (R16.2), nil before the
// bundle is loaded.
func (a *agent) statements() []string {
	if b := a.s.cfg.Bundle.Now(); b != nil {
		return b.KeyStatements
	}
	return nil
}

// Keys returns the rotation statements (R16.2). They need no signature of
// their own: the daemon applies a statement only when a key it pins signed
// it, so this answers anyone the gateway relays.
func (a *agent) Keys(ctx context.Context, req *connect.Request[agentv1.KeysRequest]) (*connect.Response[agentv1.KeysResponse], error) {
	// R19.3: the time is a hint bcd uses to correct its clock before it
	// retries a join or renewal refused for its time; unsigned, it never
	// decides trust (the server enforces its own windows).
	res := &agentv1.KeysResponse{ServerTimeUnixMs: a.s.cfg.Clock.Now().UnixMilli(), KeyStatements: a.statements()}
	return connect.NewResponse(res), nil
}

// AgentHandler serves the agent protocol for gateways. It must be served on
// a listener that requires client certificates from the serving CA (see
// AgentTLSConfig); requests without a verified client certificate are
// refused here too, so mounting it elsewhere by mistake exposes nothing.
func (s *Server) AgentHandler() http.Handler {
	h := s.agentMux()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.TLS == nil || len(r.TLS.VerifiedChains) == 0 {
			http.Error(w, "a gateway client certificate is required\n", http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// LocalAgentHandler is the agent protocol for a gateway in this process
// (serve's [gateway] listen, and dev), which calls it in memory: the same
// handlers as AgentHandler without the client-certificate check.
//
// SECURITY: the caller's authority is holding this value; it stands in for
// the gateway's mTLS identity. server.Run hands it to the gateway it builds
// and to nothing else: never serve it on a listener. The gateway sets the
// Bc-Peer-* headers from the daemon's connection as it does over the
// network and never forwards a daemon's own (internal/gateway/inprocess.go
// says what binds each field).
func (s *Server) LocalAgentHandler() http.Handler { return s.agentMux() }

// AgentStreams serves the agent protocol for gateways on h2server (the
// agent listener with [agent] http2 = "framer"): SessionService.Connect on
// the session service's callbacks (no goroutine per idle session), every
// other stream with other, AgentHandler as the caller wraps it, on a
// goroutine while it runs. A session stream without a verified client
// certificate goes to other too, which refuses it as AgentHandler does.
// Sessions on callbacks are traced as on the connect handler: a server
// span per session, a child of the gateway's traceparent, with the
// session's transactions under it (session.Streams).
func (s *Server) AgentStreams(other http.Handler) h2server.Handler {
	sessions := s.sessions.Streams(session.StreamOptions{ReadMaxBytes: agentMaxBytes, SendMaxBytes: agentMaxBytes, Tracer: s.cfg.Tracer})
	rest := h2server.HTTP(other)
	return h2server.HandlerFunc(func(st *h2server.Stream) h2server.StreamHandler {
		if tls := st.Request().TLS; tls != nil && len(tls.VerifiedChains) > 0 {
			if h := sessions.Serve(st); h != nil {
				return h
			}
		}
		return rest.ServeStream(st)
	})
}

// agentMaxBytes bounds a message on the agent listener, both ways.
const agentMaxBytes = 64 << 10

// agentMux is the agent protocol's routes: JoinService, SessionService and
// the readiness gateways check.
func (s *Server) agentMux() http.Handler {
	// SECURITY: no request decompression on this listener either (see
	// New): connect-go inflates a compressed message to its end before it
	// refuses it as too large, and the gateway relaying here is not
	// trusted. Gateways never compress toward the API.
	noGzip := connect.WithCompression("gzip", nil, nil)
	path, h := agentv1connect.NewJoinServiceHandler(&agent{s: s},
		connect.WithReadMaxBytes(agentMaxBytes),
		noGzip,
		connect.WithInterceptors(wire.Interceptor(s.log)),
	)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	mux.Handle(s.sessions.Handler(connect.WithReadMaxBytes(agentMaxBytes), connect.WithSendMaxBytes(agentMaxBytes), noGzip))
	// Gateways check each replica's readiness (its database) here.
	mux.HandleFunc("GET /readyz", s.ready)
	// A server span per call, a child of the gateway's (trace context
	// carries no authority: it only labels spans).
	// Its callers are authenticated gateways (AgentHandler checks their
	// client certificate; LocalAgentHandler is held in-process only), so
	// their sampling decision stands and a trace runs on unbroken.
	return tracing.Handler(s.cfg.Tracer, mux, tracing.TrustCallerSampling())
}

// Join exposes JoinService in-process (tests and the load generator's
// calibration).
func (s *Server) Join() *join.Service { return s.join }
