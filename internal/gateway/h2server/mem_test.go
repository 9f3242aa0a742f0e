package h2server

import (
	"bufio"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// BenchmarkIdleConnMemory holds N TLS connections (default 1000,
// $H2SERVER_MEM_CONNS), each with one open gRPC-like stream that has
// carried one message each way, and reports the server's heap and stacks
// per connection after a GC, for this server and for net/http's HTTP/2
// server holding the same streams (a handler per stream, as the gateway
// today). The clients run in a child process, so only the server's
// memory is counted ($H2SERVER_MEM_PROFILE=path writes a heap profile of
// each server, every allocation sampled):
//
//	go test -run XXX -bench IdleConnMemory -benchtime 1x ./internal/gateway/h2server/
func BenchmarkIdleConnMemory(b *testing.B) {
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("H2SERVER_MEM_CONNS")); err == nil && v > 0 {
		n = v
	}
	if os.Getenv("H2SERVER_MEM_PROFILE") != "" {
		runtime.MemProfileRate = 1 // every allocation in the profile
	}
	cert, _ := testCert(b)
	b.Run("h2server", func(b *testing.B) {
		var open atomic.Int64
		h := HandlerFunc(func(s *Stream) StreamHandler {
			open.Add(1)
			_ = s.WriteHeaders(200, http.Header{"Content-Type": {"application/grpc"}}, false)
			return echoStreams{}
		})
		s, err := New(Config{Handler: h, TLS: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}})
		if err != nil {
			b.Fatal(err)
		}
		ln := listen(b)
		done := make(chan error, 1)
		go func() { done <- s.Serve(ln) }()
		measure(b, ln.Addr().String(), n, &open)
		s.Close()
		<-done
	})
	b.Run("net/http", func(b *testing.B) {
		var open atomic.Int64
		hs := &http.Server{
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				open.Add(1)
				w.Header().Set("Content-Type", "application/grpc")
				w.WriteHeader(200)
				w.(http.Flusher).Flush()
				buf := make([]byte, 512)
				for {
					k, err := r.Body.Read(buf)
					if k > 0 {
						_, _ = w.Write(buf[:k])
						w.(http.Flusher).Flush()
					}
					if err != nil {
						return
					}
				}
			}),
			TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}},
		}
		ln := listen(b)
		done := make(chan error, 1)
		go func() { done <- hs.ServeTLS(ln, "", "") }()
		measure(b, ln.Addr().String(), n, &open)
		hs.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			b.Error(err)
		}
	})
}

func listen(b *testing.B) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	return ln
}

// echoStreams echoes what each stream sends and keeps nothing of its
// own: what a relay's per-stream state would add is not this server's.
type echoStreams struct{}

func (echoStreams) Data(s *Stream, p []byte, end bool) {
	if len(p) > 0 {
		_ = s.Write(p)
	}
	if end {
		_ = s.End()
	}
}

func (echoStreams) Sent(s *Stream, n int) { s.Consumed(n) }
func (echoStreams) Closed(*Stream, error) {}

// measure starts the child holding n streams on addr, waits until the
// server has them all, and reports the server's memory per connection.
func measure(b *testing.B, addr string, n int, open *atomic.Int64) {
	before := memNow()
	cmd := exec.Command(os.Args[0], "-test.run=^TestMemClients$")
	cmd.Env = append(os.Environ(), "H2SERVER_MEM_CLIENT="+addr, "H2SERVER_MEM_CONNS="+strconv.Itoa(n))
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || line != "ready\n" {
		b.Fatalf("the clients: %q, %v", line, err)
	}
	if got := open.Load(); got != int64(n) {
		b.Fatalf("the server saw %d streams, want %d", got, n)
	}
	after := memNow()
	per := float64(after.mem-before.mem) / float64(n)
	b.ReportMetric(per, "bytes/conn")
	b.ReportMetric(float64(after.goroutines-before.goroutines)/float64(n), "goroutines/conn")
	b.Logf("%d connections: heap+stacks %d -> %d bytes, %.0f bytes (%.1f KiB) per connection, of which stacks %.0f; goroutines %d -> %d",
		n, before.mem, after.mem, per, per/1024, float64(after.stacks-before.stacks)/float64(n), before.goroutines, after.goroutines)
	if p := os.Getenv("H2SERVER_MEM_PROFILE"); p != "" {
		f, err := os.Create(p + "." + strings.ReplaceAll(b.Name(), "/", "_"))
		if err == nil {
			_ = pprof.Lookup("heap").WriteTo(f, 0)
			f.Close()
		}
	}
	stdin.Close()
	_ = cmd.Wait()
}

type memFigures struct {
	mem, stacks uint64
	goroutines  int
}

func memNow() memFigures {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return memFigures{mem: m.HeapInuse + m.StackInuse, stacks: m.StackInuse, goroutines: runtime.NumGoroutine()}
}

// TestMemClients is BenchmarkIdleConnMemory's child: it opens the
// connections and streams, says "ready" once every stream has its answer,
// and holds them until its stdin closes.
func TestMemClients(t *testing.T) {
	addr := os.Getenv("H2SERVER_MEM_CLIENT")
	if addr == "" {
		t.Skip("BenchmarkIdleConnMemory's child process")
	}
	n, _ := strconv.Atoi(os.Getenv("H2SERVER_MEM_CONNS"))
	conns := make([]net.Conn, 0, n)
	var hb []byte
	for range n {
		enc := hpack.NewEncoder((*sliceWriter)(&hb)) // a table per connection
		nc, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, nc)
		if err := openHeldStream(nc, enc, &hb); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Println("ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	for _, c := range conns {
		c.Close()
	}
}

// openHeldStream sends the preface, SETTINGS, a session-like request and
// one message, and reads until the echo of the message.
func openHeldStream(nc net.Conn, enc *hpack.Encoder, hb *[]byte) error {
	fr := http2.NewFramer(nc, nc)
	if _, err := io.WriteString(nc, http2.ClientPreface); err != nil {
		return err
	}
	if err := fr.WriteSettings(); err != nil {
		return err
	}
	*hb = (*hb)[:0]
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "https"}, {":authority", "gateway.example"},
		{":path", "/bettercompute.agent.v1.SessionService/Connect"}, {"content-type", "application/grpc"}, {"te", "trailers"},
		{"user-agent", "grpc-go/1.0 bcd"}, {"grpc-accept-encoding", "identity"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: *hb, EndHeaders: true}); err != nil {
		return err
	}
	if err := fr.WriteData(1, false, AppendMessage(nil, 0, make([]byte, 200))); err != nil {
		return err
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				if err := fr.WriteSettingsAck(); err != nil {
					return err
				}
			}
		case *http2.DataFrame:
			if len(f.Data()) > 0 {
				return nil
			}
		case *http2.RSTStreamFrame, *http2.GoAwayFrame:
			return fmt.Errorf("refused: %v", f)
		}
	}
}
