package server

import (
	"crypto/tls"
	"log/slog"
	"net"
	"net/http"
	"sync"

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
	h1 *connListener
}

func newAgentFramer(as *http.Server, srv *api.Server, log *slog.Logger) (*agentFramer, error) {
	f := &agentFramer{h1: newConnListener()}
	h2, err := h2server.New(h2server.Config{
		Handler:          srv.AgentStreams(as.Handler),
		TLS:              as.TLSConfig,
		Other:            f.h1.hand,
		Clock:            clock.Real{},
		Log:              log.With("listener", "agent"),
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

// connListener is a net.Listener of the connections h2server hands over
// (HTTP/1.1 after the TLS handshake), for net/http's Serve.
type connListener struct {
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

func newConnListener() *connListener {
	return &connListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

// hand passes c to Accept, or closes it once the listener is closed.
func (l *connListener) hand(c *tls.Conn) {
	select {
	case l.conns <- c:
	case <-l.done:
		c.Close()
	}
}

func (l *connListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *connListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *connListener) Addr() net.Addr { return handedAddr{} }

type handedAddr struct{}

func (handedAddr) Network() string { return "h2server" }
func (handedAddr) String() string  { return "handed-over" }
