package gateway

import (
	"crypto/tls"
	"log/slog"
	"time"

	"github.com/better-compute/better-compute/internal/gateway/h2server"
)

// The limits of the daemons' side, the same on both HTTP/2 servers
// (Config.DaemonHTTP2).
const (
	// handshakeTimeout bounds the TLS handshake and a request's headers
	// (net/http's ReadHeaderTimeout; h2server's HandshakeTimeout, which
	// covers the handshake, the client preface and the first SETTINGS).
	handshakeTimeout = 10 * time.Second
	idleTimeout      = 120 * time.Second
	maxHeaderBytes   = 32 << 10
	// maxStreamsPerConn is net/http's default, made explicit for both.
	maxStreamsPerConn = 250
	// Pings find daemons that vanished without closing their connection.
	pingInterval = 60 * time.Second
	pingTimeout  = 20 * time.Second
	// maxQueuedPerStream bounds what one stream buffers (net/http's
	// MaxReceiveBufferPerStream; h2server's MaxQueuedBytes).
	maxQueuedPerStream = 256 << 10
)

// newFramer builds the daemons' side on h2server (daemon_http2 =
// "framer"): the gateway's handler on every HTTP/2 stream (but sessions,
// with session_relay = "callbacks": session_callbacks.go), and a
// connection that negotiated HTTP/1.1 handed to g.hs, net/http, through
// g.h1.
func (g *Gateway) newFramer(tlsCfg *tls.Config) error {
	g.h1 = h2server.NewHandOver()
	srv, err := h2server.New(h2server.Config{
		Handler:              g.framerHandler(),
		TLS:                  tlsCfg,
		Other:                g.h1.Hand,
		Clock:                g.clock,
		Log:                  g.log,
		ErrorLog:             g.lines.ErrorLog(slog.LevelWarn, "gateway"),
		HandshakeTimeout:     handshakeTimeout,
		IdleTimeout:          idleTimeout,
		PingInterval:         pingInterval,
		PingTimeout:          pingTimeout,
		MaxConcurrentStreams: maxStreamsPerConn,
		MaxHeaderListSize:    maxHeaderBytes,
		MaxQueuedBytes:       maxQueuedPerStream,
		// net/http's ReadTimeout, per stream; session streams lift it
		// (session.go).
		ReadTimeout: g.cfg.RequestTimeout + 10*time.Second,
	})
	if err != nil {
		return err
	}
	g.h2 = srv
	return nil
}
