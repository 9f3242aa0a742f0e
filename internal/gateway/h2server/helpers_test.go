package h2server

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// testCert is a self-signed serving certificate for 127.0.0.1 and its
// pool.
func testCert(t testing.TB) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "h2server test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
		IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, pool
}

// startTLS serves cfg over TLS on loopback; it returns the address and
// the pool that verifies the server.
func startTLS(t testing.TB, cfg Config) (*Server, string, *x509.CertPool) {
	t.Helper()
	cert, pool := testCert(t)
	cfg.TLS = &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}}
	s, addr := start(t, cfg)
	return s, addr, pool
}

// start serves cfg on loopback (in the clear unless cfg.TLS is set).
func start(t testing.TB, cfg Config) (*Server, string) {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; !errors.Is(err, ErrServerClosed) {
			t.Errorf("Serve: %v", err)
		}
	})
	return s, ln.Addr().String()
}

// x2Client is golang.org/x/net/http2's client; stdClient is net/http's,
// HTTP/2 only.
func x2Client(pool *x509.CertPool) *http.Client {
	return &http.Client{Transport: &http2.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
}

func stdClient(pool *x509.CertPool) *http.Client {
	var p http.Protocols
	p.SetHTTP2(true)
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, Protocols: &p, ForceAttemptHTTP2: true}}
}

// rawClient speaks HTTP/2 frame by frame, for the hostile cases.
type rawClient struct {
	t    testing.TB
	nc   net.Conn
	fr   *http2.Framer
	hbuf []byte
	henc *hpack.Encoder
	// wmu serializes writes from the test and its writer goroutines.
	wmu sync.Mutex
}

// dialRaw connects in the clear and sends the preface and SETTINGS.
func dialRaw(t testing.TB, addr string, settings ...http2.Setting) *rawClient {
	t.Helper()
	nc, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	c := &rawClient{t: t, nc: nc, fr: http2.NewFramer(nc, nc)}
	c.henc = hpack.NewEncoder((*sliceWriter)(&c.hbuf))
	if _, err := io.WriteString(nc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := c.fr.WriteSettings(settings...); err != nil {
		t.Fatal(err)
	}
	return c
}

type sliceWriter []byte

func (w *sliceWriter) Write(p []byte) (int, error) { *w = append(*w, p...); return len(p), nil }

// headers encodes a POST to /echo with extra fields.
func (c *rawClient) headers(extra ...string) []byte {
	c.hbuf = c.hbuf[:0]
	fields := []string{":method", "POST", ":scheme", "http", ":authority", "x", ":path", "/echo"}
	fields = append(fields, extra...)
	for i := 0; i < len(fields); i += 2 {
		_ = c.henc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return append([]byte(nil), c.hbuf...)
}

// open starts stream id.
func (c *rawClient) open(id uint32, end bool) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.headers(), EndHeaders: true, EndStream: end})
}

func (c *rawClient) do(f func(fr *http2.Framer) error) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return f(c.fr)
}

// until reads frames until match returns true; it fails the test if the
// connection ends first.
func (c *rawClient) until(what string, match func(http2.Frame) bool) http2.Frame {
	c.t.Helper()
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			c.t.Fatalf("waiting for %s: %v", what, err)
		}
		if match(f) {
			return f
		}
	}
}

// goAway reads until GOAWAY and then the connection's end.
func (c *rawClient) goAway() *http2.GoAwayFrame {
	c.t.Helper()
	ga := c.until("GOAWAY", func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }).(*http2.GoAwayFrame)
	c.closed()
	return ga
}

// closed reads until the connection ends.
func (c *rawClient) closed() {
	c.t.Helper()
	for {
		if _, err := c.fr.ReadFrame(); err != nil {
			return
		}
	}
}

// waitArmed waits until the fake clock has n timers armed.
func waitArmed(t testing.TB, f *clock.Fake, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.WaitArmed(ctx, n); err != nil {
		t.Fatalf("waiting for %d timers armed (armed: %v): %v", n, f.Deadlines(), err)
	}
}

// holdHandler answers each stream's headers and then holds it open,
// echoing what it receives; it counts the streams it served.
type holdHandler struct {
	mu      sync.Mutex
	streams []*Stream
	closed  chan error
}

func newHold() *holdHandler { return &holdHandler{closed: make(chan error, 64)} }

func (h *holdHandler) ServeStream(s *Stream) StreamHandler {
	h.mu.Lock()
	h.streams = append(h.streams, s)
	h.mu.Unlock()
	_ = s.WriteHeaders(200, http.Header{"Content-Type": {"application/grpc"}}, false)
	return h
}

func (h *holdHandler) Data(s *Stream, p []byte, end bool) {
	if len(p) > 0 {
		_ = s.Write(p)
	}
	if end {
		_ = s.End()
	}
}

func (h *holdHandler) Sent(s *Stream, n int) { s.Consumed(n) }

func (h *holdHandler) Closed(s *Stream, err error) { h.closed <- err }

func (h *holdHandler) stream(i int) *Stream {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.streams[i]
}
