package h2server

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/shared/clock"
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

// failOnce is a listener whose first Accept fails as when the process is
// out of descriptors.
type failOnce struct {
	net.Listener
	failed bool
}

func (l *failOnce) Accept() (net.Conn, error) {
	if !l.failed {
		l.failed = true
		return nil, errors.New("accept: too many open files")
	}
	return l.Listener.Accept()
}

// TestAcceptRetried: a failed Accept is retried after a backoff on the
// server's clock, and Close ends the wait.
func TestAcceptRetried(t *testing.T) {
	for _, closeInWait := range []bool{false, true} {
		t.Run(map[bool]string{false: "retried", true: "closed while waiting"}[closeInWait], func(t *testing.T) {
			fake := clock.NewFake(t0)
			s, err := New(Config{Handler: newHold(), Clock: fake})
			if err != nil {
				t.Fatal(err)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- s.Serve(&failOnce{Listener: ln}) }()
			waitArmed(t, fake, 1) // the backoff
			if closeInWait {
				s.Close()
				if err := <-done; !errors.Is(err, ErrServerClosed) {
					t.Fatalf("Serve: %v", err)
				}
				return
			}
			fake.Advance(time.Second)
			c := dialRaw(t, ln.Addr().String())
			c.until("SETTINGS ACK", isSettingsAck)
			s.Close()
			if err := <-done; !errors.Is(err, ErrServerClosed) {
				t.Fatalf("Serve: %v", err)
			}
		})
	}
}
