package h2server

import (
	"crypto/tls"
	"net"
	"sync"
)

// HandOver is a net.Listener of the connections a Server hands over
// (Config.Other: HTTP/1.1 after the TLS handshake), for net/http's Serve.
type HandOver struct {
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

// NewHandOver returns an open HandOver; set its Hand as Config.Other.
func NewHandOver() *HandOver {
	return &HandOver{conns: make(chan net.Conn), done: make(chan struct{})}
}

// Hand passes c to Accept, or closes it once the listener is closed.
func (l *HandOver) Hand(c *tls.Conn) {
	select {
	case l.conns <- c:
	case <-l.done:
		c.Close()
	}
}

// Accept returns the next connection handed over.
func (l *HandOver) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close ends Accept; later hand-overs are closed.
func (l *HandOver) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

// Addr is a placeholder: the connections come from the Server's listener.
func (l *HandOver) Addr() net.Addr { return handedAddr{} }

type handedAddr struct{}

func (handedAddr) Network() string { return "h2server" }
func (handedAddr) String() string  { return "handed-over" }
