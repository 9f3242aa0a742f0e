package apitest

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/gateway"
)

// ServeGateway serves g on a loopback port, as `better-compute gateway`
// does, and shuts it down (2 s grace) when the test ends, waiting for it. It returns the
// address daemons dial.
func ServeGateway(t testing.TB, g *gateway.Gateway) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); _ = g.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = g.Shutdown(ctx) // returns once the gateway's goroutines ended
		<-served
	})
	return ln.Addr().String()
}
