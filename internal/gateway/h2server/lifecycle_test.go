package h2server

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
)

// TestCloseJoinsItsGoroutines: Close ends the connections (one in its
// TLS handshake, one with a handler blocked reading a request body) and
// waits for every goroutine the server started.
func TestCloseJoinsItsGoroutines(t *testing.T) {
	before := goroutines.Take()
	cert, pool := testCert(t)
	s, err := New(Config{Handler: HTTP(echoHTTP()), TLS: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()

	client := x2Client(pool)
	pr, pw := io.Pipe()
	req, _ := http.NewRequest("POST", "https://"+ln.Addr().String()+"/lines", pr)
	res, err := client.Do(req) // the handler has flushed its headers and reads the body
	if err != nil {
		t.Fatal(err)
	}
	slow, err := net.Dial("tcp", ln.Addr().String()) // never starts its handshake
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()

	s.Close()
	if err := <-done; !errors.Is(err, ErrServerClosed) {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := io.ReadAll(res.Body); err == nil {
		t.Error("the held response ended cleanly after Close")
	}
	pw.Close()
	res.Body.Close()
	client.CloseIdleConnections()
	goroutines.Joined(t, before, "internal/gateway/h2server")
}
