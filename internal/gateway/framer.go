package gateway

import (
	"crypto/tls"
	"net"
	"sync"
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
	g.h1 = newConnListener()
	srv, err := h2server.New(h2server.Config{
		Handler:              g.framerHandler(),
		TLS:                  tlsCfg,
		Other:                g.h1.hand,
		Clock:                g.clock,
		Log:                  g.log,
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
