package server

import (
	"log/slog"
	"net/http"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// agentFramer serves the agent listener on h2server ([agent] http2 =
// "framer"): node sessions on the session service's callbacks, every
// other call through as's handler (the call tracker and AgentHandler),
// and a connection that negotiated HTTP/1.1 handed to as, net/http,
// through h1. The limits are net/http's on the listener (listenAgent).
type agentFramer struct {
	h2 *h2server.Server
	h1 *h2server.HandOver
}

func newAgentFramer(as *http.Server, srv *api.Server, log *slog.Logger) (*agentFramer, error) {
	f := &agentFramer{h1: h2server.NewHandOver()}
	h2, err := h2server.New(h2server.Config{
		Handler:          srv.AgentStreams(as.Handler),
		TLS:              as.TLSConfig,
		Other:            f.h1.Hand,
		Clock:            clock.Real{},
		Log:              log.With("listener", "agent"),
		ErrorLog:         as.ErrorLog,
		HandshakeTimeout: as.ReadHeaderTimeout,
		IdleTimeout:      as.IdleTimeout,
		PingInterval:     as.HTTP2.SendPingTimeout,
		PingTimeout:      as.HTTP2.PingTimeout,
		// A gateway multiplexes its nodes' sessions over a few
		// connections (listenAgent's MaxConcurrentStreams).
		MaxConcurrentStreams: uint32(as.HTTP2.MaxConcurrentStreams),
		MaxHeaderListSize:    uint32(as.MaxHeaderBytes),
		// The budget against rapid resets is for clients nobody
		// authenticated. A gateway (mTLS) ends a stream with RST_STREAM
		// whenever its daemon left, and a site's daemons leave together:
		// at h2server's default (100 a second) that would end the
		// connection and with it every other session it carries. Two
		// frames per stream the connection may hold (a reset, and DATA
		// that crossed the session's end) in one second.
		ControlFramesPerSecond: 2 * as.HTTP2.MaxConcurrentStreams,
		MaxQueuedBytes:         as.HTTP2.MaxReceiveBufferPerStream,
		// net/http's ReadTimeout, per stream; session streams lift it
		// (Service.Handler) or do not read through it (callbacks).
		ReadTimeout: as.ReadTimeout,
	})
	if err != nil {
		return nil, err
	}
	f.h2 = h2
	return f, nil
}
