package session_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// What the API holds per idle session on each transport of the agent
// listener, measured: this process serves the session service (SQLite,
// the agent listener's limits) and a child process opens the sessions as
// a gateway does (upstreamConns HTTP/2 connections, Challenge, Hello,
// Welcome; no heartbeat while measured: the heartbeat interval is an
// hour), so the client's memory is not counted. Heap, stacks, RSS and
// goroutines after a GC, before and with the sessions held, divided by
// their number. On callbacks ("framer") a held session must cost at most
// maxBytesPerSession of heap and stacks (and of RSS, from
// 2,000 sessions on, where the runtime's own growth is amortized), and no
// goroutine: only the connections' goroutines are added.
// BC_API_SESSION_MEM_PROFILE=path writes the heap profile with the
// sessions held to path.net-http and path.framer. BC_API_SESSION_MEM=N measures N sessions (default 1,000);
// -short skips it.
func TestAPISessionMemory(t *testing.T) {
	if os.Getenv(memClientEnv) != "" {
		t.Skip("the child of TestAPISessionMemory")
	}
	if testing.Short() {
		t.Skip("opens a thousand sessions")
	}
	n := 1000
	if v, err := strconv.Atoi(os.Getenv("BC_API_SESSION_MEM")); err == nil && v > 0 {
		n = v
	}
	for _, transport := range apitest.AgentTransports {
		t.Run(transport, func(t *testing.T) {
			per := measureSessions(t, transport, n)
			t.Logf("%s, %d sessions, per session: heap %.1f KiB, stacks %.1f KiB, RSS %.1f KiB, %.3f goroutines",
				transport, n, per.heap/1024, per.stack/1024, per.rss/1024, per.goroutines)
			if transport != apitest.AgentFramer {
				return
			}
			if b := per.heap + per.stack; b > maxBytesPerSession {
				t.Errorf("heap and stacks per session %.1f KiB, over %d KiB", b/1024, maxBytesPerSession>>10)
			}
			if n >= 2000 && per.rss > maxBytesPerSession {
				t.Errorf("RSS per session %.1f KiB, over %d KiB", per.rss/1024, maxBytesPerSession>>10)
			}
			// A goroutine per connection (upstreamConns) and the
			// service's check of held sessions, not one per session.
			if extra := per.goroutines * float64(n); extra > upstreamConns+fixedGoroutines {
				t.Errorf("%.0f goroutines more with %d idle sessions held, want at most %d (one per connection and the check of held sessions)",
					extra, n, upstreamConns+fixedGoroutines)
			}
		})
	}
}

const (
	memClientEnv       = "BC_API_SESSION_MEM_CLIENT"
	maxBytesPerSession = 32 << 10
	upstreamConns      = 4
	// fixedGoroutines is what holding any session starts: the check of
	// held sessions (poll), and room for a transient one (a timer's).
	fixedGoroutines = 2
)

// memPlan is what the child needs to open the sessions.
type memPlan struct {
	URL                string
	GatewayCert, GwKey string // PEM
	ServingCA          string // PEM
	NodeKey            string // PEM (PKCS#8), every node's
	Nodes              []string
	DERs               [][]byte
}

type perSession struct{ heap, stack, rss, goroutines float64 }

type memSample struct {
	heap, stack, rss uint64
	goroutines       int
}

func sample() memSample {
	runtime.GC()
	debug.FreeOSMemory()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	s := memSample{heap: m.HeapInuse, stack: m.StackInuse, goroutines: runtime.NumGoroutine()}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for l := range strings.SplitSeq(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.ParseUint(f[1], 10, 64)
				s.rss = kb << 10
			}
		}
	}
	return s
}

// measureSessions serves the session service on transport, has a child
// open n sessions, and returns the cost of each.
func measureSessions(t *testing.T, transport string, n int) perSession {
	db := storetest.OpenSQLite(t)
	b, err := ca.Generate("mem.example.com", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	svc := session.New(session.Config{DB: db, Bundle: b, Heartbeat: time.Hour})
	t.Cleanup(func() { _ = svc.Close(context.Background()) })
	opts := session.StreamOptions{ReadMaxBytes: 64 << 10, SendMaxBytes: 64 << 10}
	path, h := svc.Handler(connect.WithReadMaxBytes(opts.ReadMaxBytes), connect.WithSendMaxBytes(opts.SendMaxBytes), connect.WithCompression("gzip", nil, nil))
	mux := http.NewServeMux()
	mux.Handle(path, h)
	var url string
	if transport == apitest.AgentFramer {
		streams, rest := svc.Streams(opts), h2server.HTTP(mux)
		url = apitest.StartFramer(t, h2server.HandlerFunc(func(st *h2server.Stream) h2server.StreamHandler {
			if h := streams.Serve(st); h != nil {
				return h
			}
			return rest.ServeStream(st)
		}), b)
	} else {
		srv := httptest.NewUnstartedServer(mux)
		srv.EnableHTTP2 = true
		// The agent listener's (internal/controlplane/server listenAgent).
		srv.Config.HTTP2 = &http.HTTP2Config{MaxConcurrentStreams: 100000, MaxReadFrameSize: 16 << 10, MaxReceiveBufferPerStream: 256 << 10}
		cas := x509.NewCertPool()
		cas.AddCert(b.ServingCA)
		certPEM, keyPEM, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas}
		srv.Config.ErrorLog = slog.NewLogLogger(slog.DiscardHandler, slog.LevelError)
		srv.StartTLS()
		t.Cleanup(srv.Close)
		url = srv.URL
	}
	plan := memPlanFor(t, db, b, url, n)
	file := filepath.Join(t.TempDir(), "plan.json")
	js, err := json.Marshal(plan)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, js, 0o600); err != nil {
		t.Fatal(err)
	}
	base := sample()
	cmd := exec.Command(os.Args[0], "-test.run=^TestAPISessionMemoryClient$", "-test.count=1")
	cmd.Env = append(os.Environ(), memClientEnv+"="+file)
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
	defer func() {
		stdin.Close()
		_ = cmd.Wait()
	}()
	sc := bufio.NewScanner(stdout)
	held := false
	for sc.Scan() {
		if line := sc.Text(); line == "held" {
			held = true
			break
		} else if strings.HasPrefix(line, "error") {
			t.Fatalf("client: %s", line)
		}
	}
	if !held {
		t.Fatal("the client ended before it held its sessions")
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	if got := svc.Held(); got != n {
		t.Fatalf("held %d sessions, want %d", got, n)
	}
	// Transient goroutines (a connection's flusher, a session's worker
	// finishing its Hello) end on their own: wait for them, up to 10 s.
	at := sample()
	for end := time.Now().Add(10 * time.Second); transport == apitest.AgentFramer && at.goroutines-base.goroutines > upstreamConns+fixedGoroutines && time.Now().Before(end); {
		time.Sleep(50 * time.Millisecond)
		at = sample()
	}
	if p := os.Getenv("BC_API_SESSION_MEM_PROFILE"); p != "" {
		f, err := os.Create(p + "." + strings.ReplaceAll(transport, "/", ""))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.WriteHeapProfile(f); err != nil {
			t.Fatal(err)
		}
	}
	d := func(a, b uint64) float64 { return (float64(b) - float64(a)) / float64(n) }
	return perSession{heap: d(base.heap, at.heap), stack: d(base.stack, at.stack), rss: d(base.rss, at.rss),
		goroutines: float64(at.goroutines-base.goroutines) / float64(n)}
}

// memPlanFor records n nodes, each with a certificate for one shared key.
func memPlanFor(t *testing.T, db *store.DB, b *ca.Bundle, url string, n int) memPlan {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	k8, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	gwCert, gwKey, err := ca.IssueGateway(b, []string{"gw.test"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	plan := memPlan{URL: url, GatewayCert: string(gwCert), GwKey: string(gwKey),
		ServingCA: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: b.ServingCA.Raw})),
		NodeKey:   string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: k8}))}
	ctx := context.Background()
	now := time.Now()
	for range n {
		node := storetest.Node(t, db, store.NodeAdopted)
		c, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, &key.PublicKey, ca.NodeCertParams{TrustDomain: b.TrustDomain, SiteID: node.SiteID, NodeID: node.ID,
			Role: pki.RoleNode, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
		if err != nil {
			t.Fatal(err)
		}
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			return tx.InsertNodeCert(ctx, store.NodeCert{Serial: c.Serial, NodeID: node.ID, IdentityGeneration: node.IdentityGeneration, Role: pki.RoleNode,
				SPKISHA256: c.SPKISHA256, DER: c.DER, NotBefore: c.Cert.NotBefore, NotAfter: c.Cert.NotAfter})
		}); err != nil {
			t.Fatal(err)
		}
		plan.Nodes = append(plan.Nodes, node.ID)
		plan.DERs = append(plan.DERs, c.DER)
	}
	return plan
}

// TestAPISessionMemoryClient is TestAPISessionMemory's child: it opens
// the plan's sessions, prints "held", and holds them until its stdin
// closes.
func TestAPISessionMemoryClient(t *testing.T) {
	file := os.Getenv(memClientEnv)
	if file == "" {
		t.Skip("the child of TestAPISessionMemory")
	}
	if err := holdSessions(file); err != nil {
		fmt.Println("error", err)
		t.Fatal(err)
	}
}

func holdSessions(file string) error {
	js, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	var plan memPlan
	if err := json.Unmarshal(js, &plan); err != nil {
		return err
	}
	gw, err := tls.X509KeyPair([]byte(plan.GatewayCert), []byte(plan.GwKey))
	if err != nil {
		return err
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM([]byte(plan.ServingCA))
	blk, _ := pem.Decode([]byte(plan.NodeKey))
	if blk == nil {
		return errors.New("no node key")
	}
	k, err := x509.ParsePKCS8PrivateKey(blk.Bytes)
	if err != nil {
		return err
	}
	key := k.(*ecdsa.PrivateKey)
	clients := make([]agentv1connect.SessionServiceClient, upstreamConns)
	for i := range clients {
		tr := &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, Certificates: []tls.Certificate{gw}}}
		clients[i] = agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, plan.URL, connect.WithGRPC())
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		mu   sync.Mutex
		errc error
		wg   sync.WaitGroup
	)
	sem := make(chan struct{}, 32)
	for i, id := range plan.Nodes {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := openOne(ctx, clients[i%len(clients)], id, plan.DERs[i], key); err != nil {
				mu.Lock()
				errc = err
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if errc != nil {
		return errc
	}
	fmt.Println("held")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// openOne opens one session and leaves it open (its stream ends with ctx).
func openOne(ctx context.Context, c agentv1connect.SessionServiceClient, nodeID string, der []byte, key *ecdsa.PrivateKey) error {
	s := c.Connect(ctx)
	wire.SetPeerCertificate(s.RequestHeader(), der)
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	m, err := s.Receive()
	if err != nil {
		return fmt.Errorf("challenge: %w", err)
	}
	proof, err := pki.SignSessionProof(key, m.GetChallenge().GetNonce(), nodeID, der, nil)
	if err != nil {
		return err
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof}}}); err != nil {
		return err
	}
	if m, err = s.Receive(); err != nil || m.GetWelcome() == nil {
		return fmt.Errorf("hello answered %v, %v", m, err)
	}
	return nil
}
