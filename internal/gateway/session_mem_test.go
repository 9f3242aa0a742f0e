package gateway

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// fakeSessions is the API's SessionService reduced to holding streams: it
// speaks first with a Challenge, answers Hello with Welcome (naming
// allowedKinds), sends commands, records results, and reads until the
// stream ends. It refuses a stream without Bc-Peer-Certificate, as the API
// does. It checks no proof (the API's session tests do): it records what
// arrived, so the relay is seen to pass the nonce and the proof unchanged.
type fakeSessions struct {
	agentv1connect.UnimplementedSessionServiceHandler
	mu       sync.Mutex
	certs    []string
	proofs   [][]byte // Hello.proof as received
	allowed  []string
	commands []*agentv1.SignedCommand
	results  chan *agentv1.CommandResult
	// refuse, when set, ends a stream at once with this error; endAfter
	// ends it with this error after Welcome and the commands.
	refuse, endAfter error
	open             atomic.Int64 // streams being served
}

func (f *fakeSessions) Connect(ctx context.Context, s *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	f.open.Add(1)
	defer f.open.Add(-1)
	cert := s.RequestHeader().Get(wire.PeerCertificateHeader)
	f.mu.Lock()
	f.certs = append(f.certs, cert)
	allowed, commands, results, refuse, endAfter := f.allowed, f.commands, f.results, f.refuse, f.endAfter
	f.mu.Unlock()
	if cert == "" {
		return wire.ToWire(quietLog(), "Connect", errs.New(errs.AccessDenied, "Session refused"))
	}
	if refuse != nil {
		return wire.ToWire(quietLog(), "Connect", refuse)
	}
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Challenge{Challenge: &agentv1.Challenge{Nonce: fakeNonce}}}); err != nil {
		return nil
	}
	m, err := s.Receive()
	if err != nil || m.GetHello() == nil {
		return wire.ToWire(quietLog(), "Connect", errs.New(errs.AccessDenied, "Session refused"))
	}
	f.mu.Lock()
	f.proofs = append(f.proofs, m.GetHello().GetProof())
	f.mu.Unlock()
	if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{
		NodeId: "node_01", HeartbeatSeconds: 15, AllowedKinds: allowed}}}); err != nil {
		return nil
	}
	for _, c := range commands {
		if err := s.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: c}}); err != nil {
			return nil
		}
	}
	if endAfter != nil {
		return wire.ToWire(quietLog(), "Connect", endAfter)
	}
	for {
		m, err := s.Receive()
		if err != nil {
			return nil
		}
		if r := m.GetResult(); r != nil && results != nil {
			results <- r
		}
	}
}

// agentListenerHTTP2 is the agent listener's HTTP/2 configuration
// (internal/controlplane/server); BC_SESSION_MEM_API_DEFAULTS=1 measures against Go's
// defaults instead (250 streams per connection, 1 MiB frames).
func agentListenerHTTP2() *http.HTTP2Config {
	if os.Getenv("BC_SESSION_MEM_API_DEFAULTS") != "" {
		return nil
	}
	return &http.HTTP2Config{MaxConcurrentStreams: 100000, MaxReadFrameSize: 16 << 10, MaxReceiveBufferPerStream: 256 << 10}
}

// startSessionAPI serves fakeSessions over mTLS like the agent listener.
func startSessionAPI(t testing.TB, e *env) (*fakeSessions, string) {
	t.Helper()
	f := &fakeSessions{}
	path, h := agentv1connect.NewSessionServiceHandler(f)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.Config.HTTP2 = agentListenerHTTP2()
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return f, srv.URL
}

// fakeNonce is fakeSessions' challenge; fakeProof is what openSession
// answers with (the fake checks nothing, the relay must change nothing).
var (
	fakeNonce = bytes.Repeat([]byte{0x5a}, 32)
	fakeProof = append([]byte{0x30, 0x00, 0xff}, fakeNonce...)
)

// openSession dials gw as its own daemon (own TLS connection, from local
// if it is set) and completes Challenge, Hello, Welcome the way bcd does: it
// opens the stream without a message, reads the Challenge, then sends Hello.
func openSession(ctx context.Context, e *env, addr string, local net.Addr, certs ...tls.Certificate) (*connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage], *http.Transport, error) {
	tr := &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots, Certificates: certs},
		DialContext: (&net.Dialer{LocalAddr: local, Timeout: 30 * time.Second}).DialContext}
	s, err := openSessionOn(ctx, tr, addr)
	return s, tr, err
}

// openSessionOn is openSession over tr.
func openSessionOn(ctx context.Context, tr *http.Transport, addr string) (*connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage], error) {
	c := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+addr, connect.WithGRPC())
	s := c.Connect(ctx)
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		return s, err
	}
	m, err := s.Receive()
	if err != nil {
		return s, err
	}
	if !bytes.Equal(m.GetChallenge().GetNonce(), fakeNonce) {
		return s, fmt.Errorf("first answer is %v, want the API's Challenge", m)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: fakeProof}}}); err != nil && !errors.Is(err, io.EOF) {
		return s, err
	}
	m, err = s.Receive()
	if err == nil && m.GetWelcome() == nil {
		err = errors.New("first answer is not Welcome")
	}
	return s, err
}

// R12.1: the gateway relays a session with the daemon's certificate and
// refuses one without a certificate before reaching the API.
func TestSessionRelay(t *testing.T) { onEverySessionSide(t, testSessionRelay) }

func testSessionRelay(t *testing.T, e *env) {
	f, apiURL := startSessionAPI(t, e)
	_, gw := startGateway(t, e.config(apiURL))
	cert := e.nodeCert(t, "node_01")
	tests := []struct {
		name     string
		certs    []tls.Certificate
		wantCode errs.Code
	}{
		{name: "with a node certificate", certs: []tls.Certificate{cert}},
		{name: "without a certificate", wantCode: errs.AccessDenied},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f.mu.Lock()
			before := len(f.certs)
			f.mu.Unlock()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, tr, err := openSession(ctx, e, gw, nil, tc.certs...)
			defer tr.CloseIdleConnections()
			if tc.wantCode != "" {
				if pe := productError(t, err); pe.Code != tc.wantCode || pe.Message != "Session refused" {
					t.Fatalf("got %v", pe)
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				if len(f.certs) != before {
					t.Errorf("a session without a certificate reached the API")
				}
				return
			}
			if err != nil {
				t.Fatalf("open: %v", err)
			}
			f.mu.Lock()
			proof := f.proofs[len(f.proofs)-1]
			f.mu.Unlock()
			if !bytes.Equal(proof, fakeProof) {
				t.Errorf("the API got proof %x, want %x", proof, fakeProof)
			}
			// Heartbeats flow; ending the daemon side ends the API side.
			if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{}}}); err != nil {
				t.Fatal(err)
			}
			_ = s.CloseRequest()
			if _, err := s.Receive(); !errors.Is(err, io.EOF) {
				t.Errorf("after the daemon closed, Receive = %v, want EOF", err)
			}
		})
	}
}

// memStats is what the gateway process reports about itself.
type memStats struct {
	HeapInuse, StackInuse, Sys, RSS uint64
	Goroutines                      int
	// CPU is the process's user and system time so far.
	CPU time.Duration
}

func readMemStats() memStats {
	var cpu time.Duration
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		cpu = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	runtime.GC()
	runtime.GC()
	debug.FreeOSMemory()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	s := memStats{HeapInuse: m.HeapInuse, StackInuse: m.StackInuse, Sys: m.Sys, Goroutines: runtime.NumGoroutine(), CPU: cpu}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseUint(f[1], 10, 64)
				s.RSS = kb << 10
			}
		}
	}
	return s
}

// sessionsPerSource is how many sessions TestSessionMemory dials from one
// loopback address: toward one destination, a source address has about
// 28,000 ephemeral ports (net.ipv4.ip_local_port_range).
const sessionsPerSource = 20000

// sourceAddr is session i's local address: 127.0.0.1, then 127.0.0.2, ...
// (all of 127/8 is loopback on Linux).
func sourceAddr(i int) net.Addr {
	return &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(1+i/sessionsPerSource))}
}

// raiseNoFile lifts RLIMIT_NOFILE to at least n (the hard limit too when
// the process may).
func raiseNoFile(t testing.TB, n uint64) {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		t.Fatal(err)
	}
	if l.Cur >= n {
		return
	}
	want := l
	want.Cur = n
	if want.Max < n {
		want.Max = n
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		want.Cur = l.Max
		want.Max = l.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil || want.Cur < n {
			t.Fatalf("RLIMIT_NOFILE is %d (hard %d), %d needed: raise it (ulimit -n)", l.Cur, l.Max, n)
		}
	}
}

// TestSessionMemoryGateway is the gateway process of TestSessionMemory: it
// serves a gateway on 127.0.0.1 (the Config in BC_SESSION_MEM_GATEWAY,
// JSON), prints "ADDR host:port", then answers each line on stdin: "stats"
// with a JSON memStats, "heap PATH" by writing a heap profile to PATH. It
// shuts down at the end of stdin.
func TestSessionMemoryGateway(t *testing.T) {
	js := os.Getenv("BC_SESSION_MEM_GATEWAY")
	if js == "" {
		t.Skip("the gateway process of TestSessionMemory")
	}
	var cfg Config
	if err := json.Unmarshal([]byte(js), &cfg); err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(os.Getenv("BC_SESSION_MEM"))
	raiseNoFile(t, uint64(n)+1000)
	_, addr := startGateway(t, cfg)
	fmt.Printf("ADDR %s\n", addr)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		cmd, arg, _ := strings.Cut(sc.Text(), " ")
		switch cmd {
		case "stats":
			b, _ := json.Marshal(readMemStats())
			fmt.Printf("STATS %s\n", b)
		case "heap":
			runtime.GC()
			f, err := os.Create(arg)
			if err == nil {
				err = pprof.WriteHeapProfile(f)
				_ = f.Close()
			}
			fmt.Printf("HEAP %v\n", err)
		}
	}
}

// sessionBudgetKiB is what a session held through the callback relay may
// cost the gateway's RSS.
const sessionBudgetKiB = 32

// TestSessionMemory measures the gateway's memory per held session
// (BC_SESSION_MEM=N, e.g. 1000 or 10000; scripts/bench-sessions): the
// gateway runs in its own process (this test binary again,
// TestSessionMemoryGateway), N daemons each on its own TLS connection hold a
// session through it to a fake API, and the gateway's heap in use, stacks,
// RSS and goroutines before and after, divided by N, are its cost per held
// session. Then every daemon leaves and the gateway must be back to its
// baseline. BC_SESSION_MEM_DAEMON_HTTP2=framer measures the gateway on
// h2server, with BC_SESSION_MEM_SESSION_RELAY=callbacks its sessions on
// callbacks (then at most sessionBudgetKiB of RSS and one goroutine, the
// connection's, per session). BC_SESSION_MEM_PROFILE=path writes the gateway's heap profile
// while the sessions are held.
func TestSessionMemory(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("BC_SESSION_MEM"))
	if n <= 0 {
		t.Skip("set BC_SESSION_MEM=N to measure")
	}
	raiseNoFile(t, uint64(n)+1000)
	e := newEnv(t)
	// BC_SESSION_MEM_DAEMON_HTTP2: the gateway's daemon_http2 (default
	// net/http).
	e.kind = os.Getenv("BC_SESSION_MEM_DAEMON_HTTP2")
	// BC_SESSION_MEM_SESSION_RELAY: its session_relay (default
	// goroutines; "callbacks" needs BC_SESSION_MEM_DAEMON_HTTP2=framer).
	e.relay = os.Getenv("BC_SESSION_MEM_SESSION_RELAY")
	f, apiURL := startSessionAPI(t, e)
	cert := e.nodeCert(t, "node_01")
	cfgJSON, err := json.Marshal(e.config(apiURL))
	if err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionMemoryGateway$", "-test.timeout=0")
	cmd.Env = append(os.Environ(), "BC_SESSION_MEM_GATEWAY="+string(cfgJSON))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(stdout)
	expect := func(prefix string) string {
		for lines.Scan() {
			if rest, ok := strings.CutPrefix(lines.Text(), prefix+" "); ok {
				return rest
			}
		}
		t.Fatalf("the gateway process ended before %s", prefix)
		return ""
	}
	defer func() {
		_ = stdin.Close()
		_, _ = io.Copy(io.Discard, stdout)
		if err := cmd.Wait(); err != nil {
			t.Errorf("gateway process: %v", err)
		}
	}()
	gw := expect("ADDR")
	stats := func() memStats {
		fmt.Fprintln(stdin, "stats")
		var s memStats
		if err := json.Unmarshal([]byte(expect("STATS")), &s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	base := stats()

	type held struct {
		s  *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]
		tr *http.Transport
	}
	sessions := make([]held, n)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	start := time.Now()
	var (
		wg       sync.WaitGroup
		next     atomic.Int64
		firstErr atomic.Value
	)
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || firstErr.Load() != nil {
					return
				}
				s, tr, err := openSession(ctx, e, gw, sourceAddr(i), cert)
				sessions[i] = held{s, tr}
				if err != nil {
					firstErr.CompareAndSwap(nil, fmt.Errorf("session %d: %w", i, err))
				}
			}
		}()
	}
	wg.Wait()
	closeAll := func() {
		for _, h := range sessions {
			if h.s != nil {
				_ = h.s.CloseRequest()
				_ = h.s.CloseResponse()
				h.tr.CloseIdleConnections()
			}
		}
	}
	if err, _ := firstErr.Load().(error); err != nil {
		closeAll()
		t.Fatal(err)
	}
	opened := time.Since(start)
	at := stats()
	if p := os.Getenv("BC_SESSION_MEM_PROFILE"); p != "" {
		fmt.Fprintln(stdin, "heap "+p)
		t.Logf("heap profile: %s (%s)", p, expect("HEAP"))
	}
	per := func(a, b uint64) float64 { return (float64(b) - float64(a)) / float64(n) / 1024 }
	t.Logf("%d sessions held through one gateway (opened in %s, %.0f/s, from %d source addresses; %d upstream streams at the API)",
		n, opened.Round(time.Millisecond), float64(n)/opened.Seconds(), (n+sessionsPerSource-1)/sessionsPerSource, f.open.Load())
	perOpen := (at.CPU - base.CPU) / time.Duration(n)
	t.Logf("gateway CPU per session opened: %.3f ms (TLS handshake, HTTP/2 connection, upstream stream): %.0f sessions/s per core",
		float64(perOpen)/float64(time.Millisecond), float64(time.Second)/float64(perOpen))
	t.Logf("gateway per session: heap in use %.1f KiB, stacks %.1f KiB, RSS %.1f KiB, %.2f goroutines",
		per(base.HeapInuse, at.HeapInuse), per(base.StackInuse, at.StackInuse), per(base.RSS, at.RSS),
		float64(at.Goroutines-base.Goroutines)/float64(n))
	t.Logf("gateway totals: heap in use %.1f MiB, stacks %.1f MiB, RSS %.1f MiB (baseline RSS %.1f MiB)",
		float64(at.HeapInuse)/(1<<20), float64(at.StackInuse)/(1<<20), float64(at.RSS)/(1<<20), float64(base.RSS)/(1<<20))
	// The callback relay's budget: a held session within 32 KiB of the
	// gateway's RSS, no goroutine of its own (the daemon connection's
	// reader is the one left).
	if e.relay == SessionRelayCallbacks {
		if rss := per(base.RSS, at.RSS); rss > sessionBudgetKiB {
			t.Errorf("callbacks: %.1f KiB of RSS per held session, want at most %d KiB", rss, sessionBudgetKiB)
		}
		if g := float64(at.Goroutines-base.Goroutines) / float64(n); g > 1.05 {
			t.Errorf("callbacks: %.2f goroutines per held session, want 1 (the connection's)", g)
		}
	}

	// Every daemon leaves: the gateway and the API let go of every session.
	closeAll()
	deadline := time.Now().Add(30 * time.Second)
	for {
		s := stats()
		if s.Goroutines <= base.Goroutines+8 && f.open.Load() == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the daemons left: gateway goroutines %d (baseline %d), API streams %d", s.Goroutines, base.Goroutines, f.open.Load())
		}
		time.Sleep(200 * time.Millisecond)
	}
}
