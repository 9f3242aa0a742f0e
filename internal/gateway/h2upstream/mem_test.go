package h2upstream

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/poll"
)

// TestPeerProcess is the memory benchmark's server, in a process of its
// own so that its memory is not counted: it prints its address and
// certificate and serves until its stdin closes.
func TestPeerProcess(t *testing.T) {
	if os.Getenv("H2UPSTREAM_PEER") == "" {
		t.Skip("the benchmark's server process")
	}
	srv := grpcPeer(t, 1<<20)
	fmt.Printf("PEER %s %s\n", srv.Listener.Addr(), base64.StdEncoding.EncodeToString(srv.Certificate().Raw))
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// peerProcess starts TestPeerProcess and returns its address and a TLS
// configuration trusting it.
func peerProcess(b *testing.B) (string, *tls.Config) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestPeerProcess$")
	cmd.Env = append(os.Environ(), "H2UPSTREAM_PEER=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[0] == "PEER" {
			der, err := base64.StdEncoding.DecodeString(f[2])
			if err != nil {
				b.Fatal(err)
			}
			cert, err := x509.ParseCertificate(der)
			if err != nil {
				b.Fatal(err)
			}
			pool := x509.NewCertPool()
			pool.AddCert(cert)
			go func() { _, _ = io.Copy(io.Discard, out) }() //nolint: ends with the process
			return f[1], &tls.Config{RootCAs: pool}
		}
	}
	b.Fatal("the peer process printed no address")
	return "", nil
}

// idle is a Handler that counts response headers and messages, returning
// their window.
type idle struct{ headers, msgs atomic.Int64 }

func (h *idle) OnHeaders(*Stream, http.Header) { h.headers.Add(1) }
func (h *idle) OnMessage(s *Stream, _ []byte, window int) {
	h.msgs.Add(1)
	s.Consumed(window)
}
func (h *idle) OnSent(*Stream, int)        {}
func (h *idle) OnTrailers(*Stream, Status) {}
func (h *idle) OnReset(*Stream, error)     {}

// perStream measures what open streams hold: heap and goroutine stacks
// after open() set up n of them, over n.
func perStream(b *testing.B, n int, open func() (release func())) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&before)
	g0 := runtime.NumGoroutine()
	release := open()
	runtime.GC()
	runtime.GC() // and what sync.Pools kept through the first
	runtime.ReadMemStats(&after)
	g1 := runtime.NumGoroutine()
	release()
	heap := float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)
	stack := float64(int64(after.StackInuse)-int64(before.StackInuse)) / float64(n)
	b.ReportMetric(heap, "heapB/stream")
	b.ReportMetric(stack, "stackB/stream")
	b.ReportMetric(heap+stack, "B/stream")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/stream")
}

// BenchmarkIdleStreams holds 10,000 open gRPC streams to a server in
// another process, idle after one 1 KiB message each way (as a session
// after its Hello), with this package over 4 connections and with
// net/http's HTTP/2 client, and reports the client's memory per stream.
// Run with -benchtime=1x.
func BenchmarkIdleStreams(b *testing.B) {
	const n = 10000
	addr, tc := peerProcess(b)
	msg := make([]byte, 1024)
	b.Run("h2upstream", func(b *testing.B) {
		for b.Loop() {
			perStream(b, n, func() func() {
				cl := newClient(b, Config{Addr: addr, TLS: tc, Conns: 4})
				h := &idle{}
				streams := make([]*Stream, 0, n)
				for range n {
					s, err := cl.Open(bg, Request{Path: "/echo", Header: http.Header{"Bc-Peer-Certificate": {"x"}}}, h)
					if err != nil {
						b.Fatal(err)
					}
					if err := s.Send(msg); err != nil {
						b.Fatal(err)
					}
					streams = append(streams, s)
				}
				poll.Until(b, 120e9, "every stream's answer", func() bool { return h.headers.Load() == n && h.msgs.Load() == n })
				return func() {
					for _, s := range streams {
						_ = s.CloseSend()
					}
					cl.Close()
				}
			})
		}
	})
	b.Run("net-http", func(b *testing.B) {
		for b.Loop() {
			perStream(b, n, func() func() {
				tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
				c := &http.Client{Transport: tr}
				var bodies []io.Closer
				for range n {
					pr, pw := io.Pipe()
					req, err := http.NewRequest(http.MethodPost, "https://"+addr+"/echo", pr)
					if err != nil {
						b.Fatal(err)
					}
					req.Header.Set("Content-Type", "application/grpc")
					req.Header.Set("Bc-Peer-Certificate", "x")
					resp, err := c.Do(req)
					if err != nil {
						b.Fatal(err)
					}
					if _, err := pw.Write(frameMessage(msg)); err != nil {
						b.Fatal(err)
					}
					if _, err := readMessage(resp.Body); err != nil {
						b.Fatal(err)
					}
					bodies = append(bodies, pw, resp.Body)
				}
				return func() {
					for _, c := range bodies {
						c.Close()
					}
					tr.CloseIdleConnections()
				}
			})
		}
	})
}
