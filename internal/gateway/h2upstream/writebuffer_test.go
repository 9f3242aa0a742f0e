package h2upstream

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// unreadServer is the server's end of a net.Pipe: it reads the client's
// preface and first frames, answers with SETTINGS that open its windows
// wide, and never reads again, so nothing the client writes after that
// ever leaves (a pipe's write returns once read).
func unreadServer(t *testing.T) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		client, server := net.Pipe()
		var wg sync.WaitGroup
		t.Cleanup(func() {
			server.Close()
			wg.Wait()
		})
		wg.Go(func() {
			fr := http2.NewFramer(server, server)
			preface := make([]byte, len(http2.ClientPreface))
			if _, err := io.ReadFull(server, preface); err != nil {
				return
			}
			for range 2 { // SETTINGS, WINDOW_UPDATE
				if _, err := fr.ReadFrame(); err != nil {
					return
				}
			}
			_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
			_ = fr.WriteWindowUpdate(0, 1<<30)
		})
		return client, nil
	}
}

// TestSendDoesNotWaitForTheNetwork: a server that opened its windows but
// never reads its socket does not hold a Stream's sender. Sends return at
// once; what they queue stays bounded (the write buffer, then the
// stream's queue, then ErrQueueFull), and OnSent reports nothing, since
// no byte reached the server.
func TestSendDoesNotWaitForTheNetwork(t *testing.T) {
	const queued, buffer = 64 << 10, 32 << 10
	cl := newClient(t, Config{Addr: "api:443", Dial: unreadServer(t), Clock: clock.NewFake(time.Unix(0, 0)), WriteTimeout: time.Hour,
		PingInterval: time.Hour, MaxQueuedBytes: queued, MaxWriteBuffer: buffer, MaxMessageSize: 1 << 20})
	rec := newRecorder()
	done := make(chan struct{})
	accepted := 0
	var last error
	go func() {
		defer close(done)
		var s *Stream
		if s, last = cl.Open(bg, Request{Path: "/sink"}, rec); last != nil {
			return
		}
		msg := make([]byte, 16<<10)
		for range 100 { // 1.6 MB: far more than the bounds
			if last = s.Send(msg); last != nil {
				return
			}
			accepted += 5 + len(msg)
		}
	}()
	poll.Until(t, 10*time.Second, "the sends returned", func() bool {
		select {
		case <-done:
			return true
		default:
			return false
		}
	})
	if !errors.Is(last, ErrQueueFull) {
		t.Fatalf("the last Send: %v, want ErrQueueFull", last)
	}
	if max := buffer + maxFrameSize + queued; accepted > max {
		t.Fatalf("Send took %d bytes to a server that reads nothing, want at most %d (buffer, a frame, the queue)", accepted, max)
	}
	rec.mu.Lock()
	sent := rec.sent
	rec.mu.Unlock()
	if sent != 0 {
		t.Fatalf("OnSent reported %d bytes that never reached the server", sent)
	}
}

// TestUnreadConnectionFailsAfterWriteTimeout: a write that does not
// complete within WriteTimeout (a socket deadline, the kernel's clock)
// fails the connection, and its streams with it.
func TestUnreadConnectionFailsAfterWriteTimeout(t *testing.T) {
	cl := newClient(t, Config{Addr: "api:443", Dial: unreadServer(t), Clock: clock.NewFake(time.Unix(0, 0)), WriteTimeout: 50 * time.Millisecond,
		PingInterval: time.Hour})
	rec := newRecorder()
	if _, err := cl.Open(bg, Request{Path: "/sink"}, rec); err != nil {
		t.Fatal(err)
	}
	if _, err := rec.end(t); !errors.Is(err, ErrConnClosed) {
		t.Fatalf("the stream ended with %v, want the connection's failure", err)
	}
}
