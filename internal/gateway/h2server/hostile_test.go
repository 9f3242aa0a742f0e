package h2server

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

func isRST(id uint32) func(http2.Frame) bool {
	return func(f http2.Frame) bool {
		r, ok := f.(*http2.RSTStreamFrame)
		return ok && r.StreamID == id
	}
}

func isSettingsAck(f http2.Frame) bool {
	s, ok := f.(*http2.SettingsFrame)
	return ok && s.IsAck()
}

func TestStreamsBeyondTheLimitRefused(t *testing.T) {
	_, addr := start(t, Config{Handler: newHold(), Clock: clock.NewFake(t0)})
	c := dialRaw(t, addr)
	for i := range DefaultMaxConcurrentStreams + 1 {
		if err := c.open(uint32(2*i+1), false); err != nil {
			t.Fatal(err)
		}
	}
	last := uint32(2*DefaultMaxConcurrentStreams + 1)
	rst := c.until("RST_STREAM of the stream over the limit", func(f http2.Frame) bool {
		if h, ok := f.(*http2.HeadersFrame); ok && h.StreamID == last {
			t.Fatalf("stream %d over the limit was answered", last)
		}
		return isRST(last)(f)
	}).(*http2.RSTStreamFrame)
	if rst.ErrCode != http2.ErrCodeRefusedStream {
		t.Fatalf("RST_STREAM %v, want REFUSED_STREAM", rst.ErrCode)
	}
}

// TestControlFrameFloods: past the budget of control frames per second,
// the connection gets GOAWAY ENHANCE_YOUR_CALM and ends (rapid reset,
// CVE-2023-44487, and its relatives). The fake clock does not move, so
// every frame falls in one second.
func TestControlFrameFloods(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flood func(c *rawClient, i int) error
	}{
		{"rapid reset", func(c *rawClient, i int) error {
			id := uint32(2*i + 1)
			if err := c.open(id, false); err != nil {
				return err
			}
			return c.do(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeCancel) })
		}},
		{"pings", func(c *rawClient, i int) error {
			return c.do(func(fr *http2.Framer) error { return fr.WritePing(false, [8]byte{byte(i)}) })
		}},
		{"settings", func(c *rawClient, i int) error {
			return c.do(func(fr *http2.Framer) error { return fr.WriteSettings() })
		}},
		{"priority", func(c *rawClient, i int) error {
			return c.do(func(fr *http2.Framer) error {
				return fr.WritePriority(uint32(2*i+1), http2.PriorityParam{StreamDep: 0, Weight: 1})
			})
		}},
		{"empty data", func(c *rawClient, i int) error {
			if i == 0 {
				if err := c.open(1, false); err != nil {
					return err
				}
			}
			return c.do(func(fr *http2.Framer) error { return fr.WriteData(1, false, nil) })
		}},
		{"refused streams", func(c *rawClient, i int) error {
			return c.open(uint32(2*i+1), false) // the hold handler never ends them
		}},
		{"data on closed streams", func(c *rawClient, i int) error {
			if i == 0 {
				if err := c.open(1, true); err != nil {
					return err
				}
			}
			return c.do(func(fr *http2.Framer) error { return fr.WriteData(1, false, []byte("x")) })
		}},
		{"invalid requests", func(c *rawClient, i int) error {
			c.wmu.Lock()
			defer c.wmu.Unlock()
			c.hbuf = c.hbuf[:0]
			_ = c.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "GET"}) // no :path: a stream error
			return c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: c.hbuf, EndHeaders: true, EndStream: true})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, addr := start(t, Config{Handler: newHold(), Clock: clock.NewFake(t0), ControlFramesPerSecond: 20})
			c := dialRaw(t, addr)
			var wg sync.WaitGroup
			defer wg.Wait()
			wg.Go(func() {
				for i := range 1000 {
					if tc.flood(c, i) != nil {
						return // the server closed the connection
					}
				}
			})
			if ga := c.goAway(); ga.ErrCode != http2.ErrCodeEnhanceYourCalm {
				t.Fatalf("GOAWAY %v, want ENHANCE_YOUR_CALM", ga.ErrCode)
			}
		})
	}
}

// TestControlFramesWithinTheBudget: the same frames spread over seconds
// are answered.
func TestControlFramesWithinTheBudget(t *testing.T) {
	fake := clock.NewFake(t0)
	_, addr := start(t, Config{Handler: newHold(), Clock: fake, ControlFramesPerSecond: 20})
	c := dialRaw(t, addr)
	c.until("SETTINGS ACK", isSettingsAck)
	for round := range 5 {
		for i := range 15 {
			if err := c.do(func(fr *http2.Framer) error { return fr.WritePing(false, [8]byte{byte(round), byte(i)}) }); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 15 {
			want := [8]byte{byte(round), byte(i)}
			c.until("PING ACK", func(f http2.Frame) bool {
				if ga, ok := f.(*http2.GoAwayFrame); ok {
					t.Fatalf("GOAWAY %v in round %d", ga.ErrCode, round)
				}
				p, ok := f.(*http2.PingFrame)
				return ok && p.IsAck() && p.Data == want
			})
		}
		fake.Advance(time.Second)
	}
}

// TestContinuationFlood: a header block that goes on in CONTINUATION
// frames past MaxHeaderListSize ends the connection; the server does not
// read (or keep) the rest.
func TestContinuationFlood(t *testing.T) {
	_, addr := start(t, Config{Handler: newHold(), Clock: clock.NewFake(t0)})
	c := dialRaw(t, addr)
	var junk []byte
	enc := hpack.NewEncoder((*sliceWriter)(&junk))
	// Never indexed: the client's table stays empty.
	_ = enc.WriteField(hpack.HeaderField{Name: "x-junk", Value: strings.Repeat("j", 8000), Sensitive: true})
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		err := c.do(func(fr *http2.Framer) error {
			return fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: c.headers()})
		})
		for i := 0; err == nil && i < 10000; i++ { // 80 MB of headers if all were read
			err = c.do(func(fr *http2.Framer) error { return fr.WriteContinuation(1, false, junk) })
		}
	})
	if ga := c.goAway(); ga.ErrCode != http2.ErrCodeProtocol {
		t.Fatalf("GOAWAY %v, want PROTOCOL_ERROR", ga.ErrCode)
	}
}

// TestSlowClientsClosedAtTheHandshakeDeadline: a TLS handshake, a client
// preface or a first SETTINGS that never comes is cut at
// HandshakeTimeout.
func TestSlowClientsClosedAtTheHandshakeDeadline(t *testing.T) {
	cert, _ := testCert(t)
	for _, tc := range []struct {
		name string
		tls  bool
		send string
	}{
		{"no TLS handshake", true, ""},
		{"half a TLS record", true, "\x16\x03\x01\x02"},
		{"no preface", false, ""},
		{"half a preface", false, http2.ClientPreface[:10]},
		{"preface without SETTINGS", false, http2.ClientPreface},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := clock.NewFake(t0)
			cfg := Config{Handler: newHold(), Clock: fake, HandshakeTimeout: 10 * time.Second}
			if tc.tls {
				cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
			}
			_, addr := start(t, cfg)
			nc, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			if _, err := io.WriteString(nc, tc.send); err != nil {
				t.Fatal(err)
			}
			waitArmed(t, fake, 1)
			fake.Advance(10*time.Second - time.Nanosecond)
			if fake.Armed() != 1 {
				t.Fatal("the handshake timer fired before its deadline")
			}
			fake.Advance(time.Nanosecond)
			// The server may have written its SETTINGS; then the end.
			if _, err := io.Copy(io.Discard, nc); err != nil && !isReset(err) {
				t.Fatalf("read: %v", err)
			}
		})
	}
}

func isReset(err error) bool { return strings.Contains(err.Error(), "reset by peer") }

// stallHandler writes as much as the stream takes at once and records
// what Write answered and how the stream ended.
type stallHandler struct {
	queued  int
	lastErr error
	served  chan struct{} // closed when ServeStream returned
	closed  chan error
}

func (h *stallHandler) ServeStream(s *Stream) StreamHandler {
	_ = s.WriteHeaders(200, nil, false)
	chunk := make([]byte, 16<<10)
	for h.queued < 4<<20 {
		if h.lastErr = s.Write(chunk); h.lastErr != nil {
			break
		}
		h.queued += len(chunk)
	}
	close(h.served)
	return h
}

func (h *stallHandler) Data(*Stream, []byte, bool)  {}
func (h *stallHandler) Sent(*Stream, int)           {}
func (h *stallHandler) Closed(_ *Stream, err error) { h.closed <- err }

// TestClientThatDoesNotRead: a stream whose client never opens its window
// gets its window's worth, the handler can queue MaxQueuedBytes more and
// no more, and the stream is reset after StreamStallTimeout.
func TestClientThatDoesNotRead(t *testing.T) {
	fake := clock.NewFake(t0)
	h := &stallHandler{served: make(chan struct{}), closed: make(chan error, 1)}
	_, addr := start(t, Config{Handler: h, Clock: fake, StreamStallTimeout: time.Minute, MaxQueuedBytes: 100 << 10, PingInterval: time.Hour})
	c := dialRaw(t, addr)
	c.until("SETTINGS ACK", isSettingsAck)
	if err := c.open(1, true); err != nil {
		t.Fatal(err)
	}
	got := 0
	c.until("the window's worth of DATA", func(f http2.Frame) bool {
		if d, ok := f.(*http2.DataFrame); ok {
			got += len(d.Data())
		}
		return got >= 65535
	})
	if got != 65535 {
		t.Fatalf("got %d bytes of DATA, want the default window, 65535", got)
	}
	<-h.served
	if !errors.Is(h.lastErr, ErrQueueFull) || h.queued > 65535+100<<10 {
		t.Fatalf("queued %d bytes, last Write %v; want at most the window and MaxQueuedBytes, then ErrQueueFull", h.queued, h.lastErr)
	}
	waitArmed(t, fake, 2) // the keepalive and the stall timers
	fake.Advance(time.Minute)
	rst := c.until("RST_STREAM", isRST(1)).(*http2.RSTStreamFrame)
	if rst.ErrCode != http2.ErrCodeCancel {
		t.Fatalf("RST_STREAM %v, want CANCEL", rst.ErrCode)
	}
	var re StreamResetError
	if err := <-h.closed; !errors.As(err, &re) || re.Code != http2.ErrCodeCancel || re.Remote {
		t.Fatalf("the handler saw %v", err)
	}
}

// TestIdleConnectionClosed: a connection without streams gets GOAWAY and
// is closed after IdleTimeout, from its start or from its last stream's
// end.
func TestIdleConnectionClosed(t *testing.T) {
	for _, withStream := range []bool{false, true} {
		name := map[bool]string{false: "never a stream", true: "after a stream"}[withStream]
		t.Run(name, func(t *testing.T) {
			fake := clock.NewFake(t0)
			_, addr := start(t, Config{Handler: newHold(), Clock: fake, IdleTimeout: 2 * time.Minute, PingInterval: time.Hour})
			c := dialRaw(t, addr)
			c.until("SETTINGS ACK", isSettingsAck) // the idle and keepalive timers are armed
			if withStream {
				if err := c.open(1, true); err != nil {
					t.Fatal(err)
				}
				c.until("the stream's end", func(f http2.Frame) bool {
					d, ok := f.(*http2.DataFrame)
					return ok && d.StreamEnded()
				})
				waitArmed(t, fake, 2)
			}
			fake.Advance(2*time.Minute - time.Nanosecond)
			if fake.Armed() != 2 {
				t.Fatal("the idle timer fired before its time")
			}
			fake.Advance(time.Nanosecond)
			if ga := c.goAway(); ga.ErrCode != http2.ErrCodeNo || ga.LastStreamID != map[bool]uint32{false: 0, true: 1}[withStream] {
				t.Fatalf("GOAWAY %v last stream %d", ga.ErrCode, ga.LastStreamID)
			}
		})
	}
}

// TestShutdown: GOAWAY names the last stream taken; the connection ends
// with its streams, or when the grace runs out.
func TestShutdown(t *testing.T) {
	for _, streamEnds := range []bool{true, false} {
		name := map[bool]string{true: "stream ends", false: "grace runs out"}[streamEnds]
		t.Run(name, func(t *testing.T) {
			h := newHold()
			srv, addr := start(t, Config{Handler: h, Clock: clock.NewFake(t0)})
			c := dialRaw(t, addr)
			if err := c.open(1, false); err != nil {
				t.Fatal(err)
			}
			c.until("HEADERS", func(f http2.Frame) bool { _, ok := f.(*http2.HeadersFrame); return ok })
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- srv.Shutdown(ctx) }()
			ga := c.until("GOAWAY", func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }).(*http2.GoAwayFrame)
			if ga.LastStreamID != 1 || ga.ErrCode != http2.ErrCodeNo {
				t.Fatalf("GOAWAY last stream %d %v", ga.LastStreamID, ga.ErrCode)
			}
			want := error(nil)
			if streamEnds {
				// The stream still works: the client ends it, the echo
				// handler ends its side.
				if err := c.do(func(fr *http2.Framer) error { return fr.WriteData(1, true, []byte("bye")) }); err != nil {
					t.Fatal(err)
				}
				d := c.until("the echo", func(f http2.Frame) bool { _, ok := f.(*http2.DataFrame); return ok }).(*http2.DataFrame)
				if !bytes.Equal(d.Data(), []byte("bye")) {
					t.Fatalf("echo %q", d.Data())
				}
			} else {
				cancel()
				want = context.Canceled
			}
			c.closed()
			if err := <-done; !errors.Is(err, want) {
				t.Fatalf("Shutdown: %v, want %v", err, want)
			}
		})
	}
}

// TestKeepalivePings: a connection quiet for PingInterval gets a PING; an
// answered one keeps it, the next quiet interval brings the next PING,
// and one left unanswered for PingTimeout closes it.
func TestKeepalivePings(t *testing.T) {
	fake := clock.NewFake(t0)
	_, addr := start(t, Config{Handler: newHold(), Clock: fake, IdleTimeout: time.Hour, PingInterval: time.Minute, PingTimeout: 20 * time.Second})
	c := dialRaw(t, addr)
	c.until("SETTINGS ACK", isSettingsAck) // the keepalive timer is armed
	isPing := func(f http2.Frame) bool { p, ok := f.(*http2.PingFrame); return ok && !p.IsAck() }
	fake.Advance(time.Minute)
	ping := c.until("the first PING", isPing).(*http2.PingFrame)
	if err := c.do(func(fr *http2.Framer) error { return fr.WritePing(true, ping.Data) }); err != nil {
		t.Fatal(err)
	}
	// The ACK rearms the timer a full interval after it.
	next := fake.Now().Add(time.Minute)
	poll.Until(t, 10*time.Second, "the keepalive timer rearmed by the ACK", func() bool {
		return slices.ContainsFunc(fake.Deadlines(), next.Equal)
	})
	fake.Advance(time.Minute)
	c.until("the second PING", isPing)
	waitArmed(t, fake, 2)
	fake.Advance(20 * time.Second)
	c.closed()
}
