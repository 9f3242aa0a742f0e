package run_test

import (
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/controller"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Harness for the session tests: the real API (apitest) with its agent
// listener over mTLS, a real gateway in front of it, the controller, and
// bcd's run loop in-process against a fake procfs. Nodes join through the
// real JoinService in-process and their identity is saved as bcd saves it.
//
// The API runs on a fake clock (h.clock): the session service's checks,
// polls and timeouts fire only when a test moves it. Each bcd runs on its
// own fake clock (bcdProc.clock): heartbeats, the reconnect backoff and
// the identity check likewise.
//
// Attackers: h.attacker dials the API's agent listener directly with the
// gateway's client credentials (a compromised gateway); an evil relay
// (newEvilGateway) stands where the gateway stands, with the gateway's
// certificate, and tampers with what it relays.

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func rq[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

type harness struct {
	e        *apitest.Env
	clock    *clock.Fake // the API's
	gwAddr   string
	agentURL string          // the API's agent listener
	gwCert   tls.Certificate // the gateway's identity (serving and client)
	site     *bcv1.Site
	dir      string
	n        int // machines made so far
	gateways int // gateways started so far
	// gwTracer traces the gateways started from now on; bcdTracer and
	// bcdLog are the tracer and log of the daemons started from now on
	// (nil: none, quiet).
	gwTracer, bcdTracer trace.TracerProvider
	bcdLog              *slog.Logger
	// rejoin gives the daemons started from now on bcd run's x509pop
	// re-join (run.Config.Rejoin).
	rejoin bool
	// bcdAhead sets the clocks of the daemons started from now on this
	// far ahead of the wall clock (this machine's own clock moved on).
	bcdAhead time.Duration
	// mac: the API agrees heartbeat keys ([session] heartbeat_mac).
	mac bool
	// stack is the transports between bcd and the API.
	stack stack
}

// stack is what carries sessions between bcd and the API: the gateway's
// HTTP/2 server and session relay ([gateway] daemon_http2 and
// session_relay) and the API agent listener's HTTP/2 server ([agent]
// http2).
type stack struct {
	name         string
	daemonHTTP2  string // gateway.Config.DaemonHTTP2
	sessionRelay string // gateway.Config.SessionRelay
	agentHTTP2   string // apitest.AgentNetHTTP or apitest.AgentFramer
}

var (
	// stackNetHTTP is Go's net/http on both listeners, a session relayed
	// by two goroutines (the defaults before the callbacks).
	stackNetHTTP = stack{name: "nethttp", daemonHTTP2: gateway.DaemonHTTP2NetHTTP, sessionRelay: gateway.SessionRelayGoroutines, agentHTTP2: apitest.AgentNetHTTP}
	// stackFramer is h2server everywhere (the defaults): the gateway
	// serves daemons on it and relays sessions on its callbacks, and the
	// API holds them on its callbacks.
	stackFramer = stack{name: "framer", daemonHTTP2: gateway.DaemonHTTP2Framer, sessionRelay: gateway.SessionRelayCallbacks, agentHTTP2: apitest.AgentFramer}
	// stacks are the stacks the session tests run on.
	stacks = []stack{stackNetHTTP, stackFramer}
	// defaultOnly is for tests whose sessions the stack does not change
	// (a fake relay in front of the API's net/http, or no session).
	defaultOnly = []stack{stackNetHTTP}
)

// onStacks runs fn once per stack, as a subtest named after it.
func onStacks(t *testing.T, sts []stack, fn func(t *testing.T, st stack)) {
	t.Helper()
	for _, st := range sts {
		t.Run(st.name, func(t *testing.T) { fn(t, st) })
	}
}

// each runs fn against a fresh harness on every stack, on SQLite and on
// PostgreSQL, each with its own fake API clock.
func each(t *testing.T, fn func(t *testing.T, h *harness)) {
	t.Helper()
	eachOn(t, stacks, fn)
}

// eachOn is each on the stacks sts.
func eachOn(t *testing.T, sts []stack, fn func(t *testing.T, h *harness)) {
	t.Helper()
	onStacks(t, sts, func(t *testing.T, st stack) {
		storetest.Each(t, func(t *testing.T, db *store.DB) {
			c := clock.NewFake(time.Now())
			e := apitest.Start(t, db, apitest.Options{Clock: c})
			fn(t, newHarness(t, e, c, st))
		})
	})
}

// eachBeat runs fn as each does, once with the API's heartbeat MAC off
// (every heartbeat signed) and once with it on (h.mac: sessions whose
// daemon offers a key MAC theirs).
func eachBeat(t *testing.T, fn func(t *testing.T, h *harness)) {
	t.Helper()
	eachBeatOn(t, stacks, fn)
}

// eachBeatOn is eachBeat on the stacks sts.
func eachBeatOn(t *testing.T, sts []stack, fn func(t *testing.T, h *harness)) {
	t.Helper()
	onStacks(t, sts, func(t *testing.T, st stack) {
		for _, mac := range []bool{false, true} {
			name := "signed"
			if mac {
				name = "mac"
			}
			t.Run(name, func(t *testing.T) {
				storetest.Each(t, func(t *testing.T, db *store.DB) {
					c := clock.NewFake(time.Now())
					e := apitest.Start(t, db, apitest.Options{Clock: c, HeartbeatMAC: mac})
					h := newHarness(t, e, c, st)
					h.mac = mac
					fn(t, h)
				})
			})
		}
	})
}

// heartbeatReason is why the API ends a session on a bad heartbeat of a
// daemon that offered a heartbeat key, on this harness.
func (h *harness) heartbeatReason() string {
	if h.mac {
		return "heartbeat-mac"
	}
	return "heartbeat-signature"
}

// newHarness is the harness of e (whose clock is apiClock) on stack st.
func newHarness(t *testing.T, e *apitest.Env, apiClock *clock.Fake, st stack) *harness {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var background sync.WaitGroup
	// Registered first, so it runs after every other cleanup of the test
	// (bcd, relays, the gateway, the agent listener) and before the
	// database closes: nothing may write into a closed store.
	t.Cleanup(func() {
		cancel()
		background.Wait()
		sctx, c := context.WithTimeout(context.Background(), 10*time.Second)
		defer c()
		if err := e.Server.Sessions().Close(sctx); err != nil {
			t.Errorf("session handlers still running: %v", err)
		}
	})
	h := &harness{e: e, clock: apiClock, dir: t.TempDir(), stack: st}

	// The API's agent listener (mTLS requiring a serving-CA client
	// certificate) on the stack's HTTP/2 server, and the gateway.
	h.agentURL = h.startAgent(t, e.Server)
	h.gwAddr, h.gwCert = h.startGateway(t, h.agentURL)

	// The controller, woken like the server wakes it.
	sess := e.Server.Sessions()
	ctrl := controller.New(controller.Config{DB: e.DB, Hub: e.Server.Hub(), Log: quiet(), Poll: 100 * time.Millisecond, Notify: sess.Notify})
	sess.OnResult(ctrl.Wake)
	background.Add(2)
	go func() { defer background.Done(); ctrl.Run(ctx) }()
	go func() {
		defer background.Done()
		for {
			select {
			case <-ctx.Done():
				return
			case <-e.Server.Hub().Wait():
				ctrl.Wake()
			}
		}
	}()

	s, err := e.Admin.Sites.CreateSite(ctx, rq(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	h.site = s.Msg
	return h
}

// startAgent serves srv's agent listener on the stack's HTTP/2 server, as
// serve does, and returns its URL; it closes when the test ends.
func (h *harness) startAgent(t testing.TB, srv *api.Server) string {
	t.Helper()
	return apitest.StartServerAgentOn(t, srv, h.e.Bundle, h.stack.agentHTTP2)
}

// startGateway runs a real gateway on the harness's stack in front of the
// agent listener at apiURL and returns its address and its certificate.
func (h *harness) startGateway(t testing.TB, apiURL string) (string, tls.Certificate) {
	t.Helper()
	b := h.e.Bundle
	gwPEM, gwKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(gwPEM, gwKey)
	if err != nil {
		t.Fatal(err)
	}
	h.gateways++
	name := "gw" + strconv.Itoa(h.gateways)
	certFile, keyFile, caFile := h.write(t, name+".crt", gwPEM), h.write(t, name+".key", gwKey), h.write(t, name+"-ca.pem", pki.CertPEM(b.ServingCA))
	g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: certFile, KeyFile: keyFile, APIURL: apiURL, APICAFile: caFile,
		DaemonHTTP2: h.stack.daemonHTTP2, SessionRelay: h.stack.sessionRelay},
		gateway.Options{Log: quiet(), Tracer: h.gwTracer})
	if err != nil {
		t.Fatal(err)
	}
	return apitest.ServeGateway(t, g), cert
}

// restartable is a real gateway on the harness's stack at a fixed
// address, which a test stops and starts again (a gateway restarting).
type restartable struct {
	h    *harness
	addr string
	stop func() // shuts the running gateway down and waits for it; nil: stopped
}

// restartableGateway starts a gateway in front of the harness's agent
// listener at an address it keeps across restarts; it stops when the
// test ends.
func (h *harness) restartableGateway(t *testing.T) *restartable {
	t.Helper()
	r := &restartable{h: h, addr: "127.0.0.1:0"}
	r.start(t)
	t.Cleanup(func() { r.shutdown(t) })
	return r
}

func (r *restartable) url() string { return "https://" + r.addr }

// start runs a new gateway at r's address.
func (r *restartable) start(t *testing.T) {
	t.Helper()
	h := r.h
	b := h.e.Bundle
	gwPEM, gwKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	h.gateways++
	name := "gw" + strconv.Itoa(h.gateways)
	g, err := gateway.New(gateway.Config{Listen: r.addr, CertFile: h.write(t, name+".crt", gwPEM), KeyFile: h.write(t, name+".key", gwKey),
		APIURL: h.agentURL, APICAFile: h.write(t, name+"-ca.pem", pki.CertPEM(b.ServingCA)),
		DaemonHTTP2: h.stack.daemonHTTP2, SessionRelay: h.stack.sessionRelay}, gateway.Options{Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	r.addr = ln.Addr().String()
	served := make(chan struct{})
	go func() { defer close(served); _ = g.Serve(ln) }()
	r.stop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := g.Shutdown(ctx); err != nil {
			t.Errorf("gateway shutdown: %v", err)
		}
		<-served
	}
}

// shutdown stops the running gateway, if any.
func (r *restartable) shutdown(t *testing.T) {
	t.Helper()
	if r.stop != nil {
		r.stop()
		r.stop = nil
	}
}

func (h *harness) write(t testing.TB, name string, data []byte) string {
	t.Helper()
	p := filepath.Join(h.dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func (h *harness) pool(t *testing.T, name string, acc *bcv1.AcceptancePolicy) *bcv1.Pool {
	t.Helper()
	var pol *bcv1.PoolPolicy
	if acc != nil {
		pol = &bcv1.PoolPolicy{Acceptance: acc}
	}
	p, err := h.e.Admin.Pools.CreatePool(context.Background(), rq(&bcv1.CreatePoolRequest{TenantId: h.e.RootTenant, SiteId: h.site.Id, Name: name, Agent: "bcd", Policy: pol}))
	if err != nil {
		t.Fatal(err)
	}
	return p.Msg
}

func (h *harness) token(t *testing.T, pool *bcv1.Pool, reclaim bool) string {
	t.Helper()
	tok, err := h.e.Admin.JoinTokens.CreateJoinToken(context.Background(), rq(&bcv1.CreateJoinTokenRequest{
		TenantId: h.e.RootTenant, PoolId: pool.Id, TtlSeconds: 3600, MaxUses: 5, AllowReclaim: reclaim}))
	if err != nil {
		t.Fatal(err)
	}
	return tok.Msg.Token
}

// machine is one joined node as bcd keeps it: a data directory with its
// identity, a fake procfs, a config.
type machine struct {
	nodeID string
	store  *identity.Store
	cfg    *bcdconfig.Config
	id     *identity.Identity
	// pins are the daemon's live pin sets, kept across its restarts as
	// config.toml keeps them.
	pins *config.Pins
	// conn, when set, is offered the daemon's sessions (the renewer's
	// SessionConn).
	conn *renew.SessionConn
}

// join joins machine i (its claims) with token and saves the identity in a
// fresh data directory as bcd join does (the generation from the signed
// answer); cpus is what its fake procfs reports.
func (h *harness) join(t *testing.T, token string, i, cpus int) *machine {
	t.Helper()
	h.n++
	req, _, record := h.request(t, token, i)
	res, err := h.e.Server.Join().Join(context.Background(), req, join.Peer{Addr: "192.0.2.1:1"})
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.Body, &body); err != nil {
		t.Fatal(err)
	}
	chainPEM, bundlePEM := pemOf(body.CertChain), pemOf(body.CommandBundle)
	id, err := identity.NewIdentity(chainPEM, "", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	id.IdentityGeneration = body.GetIdentityGeneration()
	base := filepath.Join(h.dir, "m"+strconv.Itoa(h.n))
	st := &identity.Store{Dir: filepath.Join(base, "data")}
	if err := st.Save(id, record, chainPEM, bundlePEM); err != nil {
		t.Fatal(err)
	}
	loaded, err := st.Load()
	if err != nil {
		t.Fatal(err)
	}
	procfs := filepath.Join(base, "proc")
	var cpu strings.Builder
	for c := range cpus {
		cpu.WriteString("processor\t: " + strconv.Itoa(c) + "\nmodel name\t: test\n\n")
	}
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "cpuinfo"), []byte(cpu.String()))
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "meminfo"), []byte("MemTotal:       16318480 kB\nMemFree:         1000000 kB\n"))
	h.write(t, filepath.Join(strings.TrimPrefix(procfs, h.dir), "driver/nvidia/gpus/0000:3b:00.0/information"), []byte("GPU UUID: GPU-1\n"))
	pins, err := h.e.Bundle.Pins()
	if err != nil {
		t.Fatal(err)
	}
	cfg := &bcdconfig.Config{GatewayURL: "https://" + h.gwAddr, Site: h.site.Id, ServingCASPKIPin: pins.ServingCA,
		JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption, DataDir: st.Dir, ProcfsRoot: procfs}
	cfg.ApplyDefaults()
	return &machine{nodeID: id.NodeID, store: st, cfg: cfg, id: loaded}
}

// request is machine i's join request with a new software key, sealed with
// token as bcd seals it; it returns the key and its node.key record too.
func (h *harness) request(t *testing.T, token string, i int) (*agentv1.JoinRequest, crypto.Signer, []byte) {
	t.Helper()
	signer, record, err := identity.SoftwareKeys{}.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := identity.NewCSR(signer, "")
	if err != nil {
		t.Fatal(err)
	}
	req := &agentv1.JoinRequest{Csr: csr, Claims: jointest.Claims(i), Protocol: 1}
	req.SealedToken = jointest.Seal(t, h.e.Bundle, token, req)
	return req, signer, record
}

func pemOf(ders [][]byte) []byte {
	var out []byte
	for _, d := range ders {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: d})...)
	}
	return out
}

// bcdProc is one bcd run loop.
type bcdProc struct {
	clock    *clock.Fake
	welcomes chan string // the node id of every Welcome
	done     chan error  // Run's answer
	cancel   context.CancelFunc
	stopped  bool
}

// start runs bcd's loop for m through the real gateway until stop (or the
// test's end).
func (h *harness) start(t *testing.T, m *machine) *bcdProc {
	t.Helper()
	return h.startVia(t, m, "https://"+h.gwAddr)
}

// startVia runs bcd's loop for m with gatewayURL as its gateway.
func (h *harness) startVia(t *testing.T, m *machine, gatewayURL string) *bcdProc {
	t.Helper()
	return h.startWith(t, m, gatewayURL, nil)
}

// startWith is startVia with renewed as the daemon's renewal signal.
func (h *harness) startWith(t *testing.T, m *machine, gatewayURL string, renewed <-chan struct{}) *bcdProc {
	t.Helper()
	cfg := *m.cfg
	cfg.GatewayURL = gatewayURL
	p := &bcdProc{clock: clock.NewFake(time.Now().Add(h.bcdAhead)), welcomes: make(chan string, 16), done: make(chan error, 1)}
	log := h.bcdLog
	if log == nil {
		log = quiet()
	}
	if m.pins == nil {
		m.pins = config.NewPins("", m.cfg, log)
	}
	rc := run.Config{BCD: &cfg, Store: m.store, Log: log, Clock: p.clock, Rand: func() float64 { return 0.5 }, Pins: m.pins,
		OnWelcome: func(id string) { p.welcomes <- id }, Renewed: renewed, Tracer: h.bcdTracer, SessionConn: m.conn}
	if h.rejoin {
		rc.Rejoin = func(ctx context.Context) (*identity.Identity, error) {
			j, err := enroll.New(enroll.Config{BCD: &cfg, Store: m.store, Clock: p.clock, Log: log})
			if err != nil {
				return nil, err
			}
			return j.Join(ctx, enroll.Options{Attestor: identity.AttestorX509Pop})
		}
	}
	d, err := run.New(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go func() { p.done <- d.Run(ctx) }()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// stop ends the loop and checks it ended cleanly.
func (p *bcdProc) stop(t testing.TB) {
	t.Helper()
	if p.stopped {
		return
	}
	p.stopped = true
	p.cancel()
	select {
	case err := <-p.done:
		if err != nil {
			t.Errorf("bcd run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("bcd run did not stop")
	}
}

// exited waits for Run to return by itself and returns its error.
func (p *bcdProc) exited(t testing.TB) error {
	t.Helper()
	select {
	case err := <-p.done:
		p.stopped = true
		return err
	case <-time.After(15 * time.Second):
		t.Fatal("bcd run did not return")
		return nil
	}
}

// welcome waits for the next Welcome.
func (p *bcdProc) welcome(t testing.TB) string {
	t.Helper()
	select {
	case id := <-p.welcomes:
		return id
	case <-time.After(15 * time.Second):
		t.Fatal("no Welcome")
		return ""
	}
}

func (h *harness) node(t testing.TB, id string) store.Node {
	t.Helper()
	var n store.Node
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		n, err = tx.GetNode(context.Background(), id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

func (h *harness) command(t testing.TB, id string) store.Command {
	t.Helper()
	var c store.Command
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		c, err = tx.GetCommand(context.Background(), id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return c
}

// eventually polls cond every 20 ms (real time) until it holds, up to 15
// s: for what must happen, never to show that something did not.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, 15*time.Second, what, cond)
}

// waitNode waits until cond holds for the node, up to 15 s.
func (h *harness) waitNode(t testing.TB, id, what string, cond func(store.Node) bool) store.Node {
	t.Helper()
	var n store.Node
	poll.UntilDetail(t, 15*time.Second, func() string {
		return fmt.Sprintf("node %s to %s; state %s (%q), connection %s", id, what, n.State, n.StateReason, n.Connection)
	}, func() bool { n = h.node(t, id); return cond(n) })
	return n
}

// dbClockPast waits until the database's clock (compute_now, ms) is past
// t, so a write after this returns shows as later than t.
func (h *harness) dbClockPast(t testing.TB, at time.Time) {
	t.Helper()
	eventually(t, "the database clock to move", func() bool {
		var now time.Time
		if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
			var err error
			now, err = tx.Now(context.Background())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return now.After(at)
	})
}

// waitCommand waits until the command is no longer queued or sent.
func (h *harness) waitCommand(t testing.TB, id string) store.Command {
	t.Helper()
	var c store.Command
	eventually(t, "command "+id+" to finish", func() bool {
		c = h.command(t, id)
		return c.State != store.CommandQueued && c.State != store.CommandSent
	})
	return c
}

// enqueue queues a node.facts command through the operator API.
func (h *harness) enqueue(t testing.TB, nodeID string) string {
	t.Helper()
	res, err := h.e.Admin.Commands.EnqueueCommand(context.Background(), rq(&bcv1.EnqueueCommandRequest{TenantId: h.e.RootTenant, NodeId: nodeID, Kind: wire.KindNodeFacts}))
	if err != nil {
		t.Fatal(err)
	}
	return res.Msg.Id
}

// events lists the root tenant's events of the given type prefix.
func (h *harness) events(t testing.TB, prefix string) []store.Event {
	t.Helper()
	if err := h.e.DB.WaitEventsVisible(context.Background(), h.e.RootTenant, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	var evs []store.Event
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		evs, err = tx.ListEvents(context.Background(), h.e.RootTenant, 0, 0, prefix, 1000)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return evs
}

// audit lists the root tenant's audit rows on a node.
func (h *harness) audit(t testing.TB, nodeID string) []store.AuditEntry {
	t.Helper()
	var rows []store.AuditEntry
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListAudit(context.Background(), h.e.RootTenant, 0, 1000)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var out []store.AuditEntry
	for i := len(rows) - 1; i >= 0; i-- { // oldest first
		if rows[i].Resource == "compute-node/"+nodeID {
			out = append(out, rows[i])
		}
	}
	return out
}

// refusedWith reports whether a security.session.refused event names the
// node and reason.
func (h *harness) refusedWith(t testing.TB, nodeID, reason string) bool {
	t.Helper()
	return h.refusals(t, nodeID, reason) > 0
}

// refusals counts the security.session.refused events naming the node and
// reason.
func (h *harness) refusals(t testing.TB, nodeID, reason string) int {
	t.Helper()
	n := 0
	for _, ev := range h.events(t, "security.session.refused") {
		if strings.Contains(string(ev.Data), `"reason":"`+reason+`"`) && strings.Contains(string(ev.Data), `"nodeId":"`+nodeID+`"`) {
			n++
		}
	}
	return n
}

// check advances the API clock by one check interval, so the session
// service reads its held sessions against the database.
func (h *harness) check() { h.clock.Advance(session.DefaultCheck) }

// client is a session client through addr (a gateway or the agent
// listener) with tc.
func sessionClient(tc *tls.Config, url string) (agentv1connect.SessionServiceClient, func()) {
	tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
	return agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, url, connect.WithGRPC()), tr.CloseIdleConnections
}

// handshake runs bcd's side of a session's start on s: it reads the
// Challenge, sends Hello with a proof signed by key over certDER (no proof
// when key is nil) and returns the answer to Hello.
func handshake(s *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage], nodeID string, certDER []byte, key crypto.Signer) (*agentv1.SessionServerMessage, error) {
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	m, err := s.Receive()
	if err != nil {
		return nil, err
	}
	nonce := m.GetChallenge().GetNonce()
	if nonce == nil {
		return m, fmt.Errorf("first message is not a Challenge: %v", m)
	}
	var proof []byte
	if key != nil {
		if proof, err = pki.SignSessionProof(key, nonce, nodeID, certDER, nil); err != nil {
			return nil, err
		}
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof}}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return s.Receive()
}

// dial opens a session through the gateway presenting m's certificate on
// TLS (none when m is nil) and proving key (nil: no proof), and returns
// the answer to Hello or the error.
func (h *harness) dial(t testing.TB, m *machine, key crypto.Signer) (*agentv1.SessionServerMessage, error) {
	t.Helper()
	roots := x509.NewCertPool()
	roots.AddCert(h.e.Bundle.ServingCA)
	tc := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, NextProtos: []string{"h2"}}
	nodeID, der := "", []byte(nil)
	if m != nil {
		tc.Certificates = []tls.Certificate{*m.tlsCert()}
		nodeID, der = m.nodeID, m.id.Leaf().Raw
	}
	c, closeIdle := sessionClient(tc, "https://"+h.gwAddr)
	defer closeIdle()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := c.Connect(ctx)
	defer s.CloseResponse()
	return handshake(s, nodeID, der, key)
}

// attacker opens a session on the API's agent listener directly, with the
// gateway's client credentials, forwarding certDER as the daemon's
// certificate: what a compromised gateway can do. The stream stays open
// until the test ends.
func (h *harness) attacker(t testing.TB, certDER []byte) *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage] {
	t.Helper()
	roots := x509.NewCertPool()
	roots.AddCert(h.e.Bundle.ServingCA)
	c, closeIdle := sessionClient(&tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, Certificates: []tls.Certificate{h.gwCert}, NextProtos: []string{"h2"}}, h.agentURL)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	s := c.Connect(ctx)
	s.RequestHeader().Set(wire.PeerAddrHeader, "198.51.100.7:4242")
	wire.SetPeerCertificate(s.RequestHeader(), certDER)
	t.Cleanup(func() {
		_ = s.CloseRequest()
		_ = s.CloseResponse()
		cancel()
		closeIdle()
	})
	return s
}

func (m *machine) tlsCert() *tls.Certificate {
	chain := make([][]byte, len(m.id.Chain))
	for i, c := range m.id.Chain {
		chain[i] = c.Raw
	}
	return &tls.Certificate{Certificate: chain, PrivateKey: m.id.Signer, Leaf: m.id.Leaf()}
}

// evilGateway stands where the gateway stands, with the gateway's own
// certificate (so bcd's pin accepts it) and the gateway's client identity
// toward the API: a compromised gateway. It relays sessions like the real
// one and, as a test sets it up, records the signed commands it sees,
// tampers with results, drops commands, and injects recorded commands
// after Welcome.
type evilGateway struct {
	url string

	mu       sync.Mutex
	captured []*agentv1.SignedCommand // commands relayed to bcd
	results  []*agentv1.CommandResult // results from bcd, as bcd sent them
	// tamper, when set, rewrites a result before it goes to the API (nil:
	// drops it); it sees each result once, with how many came before.
	tamper func(n int, r *agentv1.CommandResult) *agentv1.CommandResult
	// drop, when set, keeps commands from bcd.
	drop bool
	// inject is sent to bcd after each Welcome.
	inject []*agentv1.SignedCommand
	// welcomeShift, when set, moves the time each Welcome claims (a
	// forged, unsigned server_time).
	welcomeShift time.Duration
	// hello and welcome, when set, rewrite each Hello (to the API) and
	// Welcome (to bcd) in place, on a copy.
	hello   func(h *agentv1.Hello)
	welcome func(w *agentv1.Welcome)
	// nonce is the last Challenge's; hellos and heartbeats are what bcd
	// sent, as it sent them.
	nonce      []byte
	hellos     []*agentv1.Hello
	heartbeats []*agentv1.Heartbeat
	// upstreams counts relayed sessions.
	upstreams int
	// behind, when set, has the relay stand behind a real gateway, between
	// it and the API: it passes on the peer headers the gateway sent
	// instead of naming its own TLS peer.
	behind bool
}

type peerCertKey struct{}

func (h *harness) newEvilGateway(t *testing.T) *evilGateway {
	t.Helper()
	roots := x509.NewCertPool()
	roots.AddCert(h.e.Bundle.ServingCA)
	up, closeIdle := sessionClient(&tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots, Certificates: []tls.Certificate{h.gwCert}, NextProtos: []string{"h2"}}, h.agentURL)
	t.Cleanup(closeIdle)
	g := &evilGateway{}
	path, handler := agentv1connect.NewSessionServiceHandler(&evilRelay{g: g, up: up})
	mux := http.NewServeMux()
	mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var der []byte
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			der = r.TLS.PeerCertificates[0].Raw
		}
		handler.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), peerCertKey{}, der)))
	}))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{h.gwCert}, ClientAuth: tls.RequestClientCert}
	srv.Config.ErrorLog = slog.NewLogLogger(quiet().Handler(), slog.LevelError)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	g.url = srv.URL
	return g
}

func (g *evilGateway) set(fn func(g *evilGateway)) {
	g.mu.Lock()
	defer g.mu.Unlock()
	fn(g)
}

func (g *evilGateway) snapshot() (captured []*agentv1.SignedCommand, results []*agentv1.CommandResult) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*agentv1.SignedCommand(nil), g.captured...), append([]*agentv1.CommandResult(nil), g.results...)
}

type evilRelay struct {
	agentv1connect.UnimplementedSessionServiceHandler
	g  *evilGateway
	up agentv1connect.SessionServiceClient
}

// upward records Hello and heartbeats from bcd and rewrites Hello as the
// test set up; it returns the message to relay to the API.
func (g *evilGateway) upward(m *agentv1.SessionClientMessage) *agentv1.SessionClientMessage {
	g.mu.Lock()
	defer g.mu.Unlock()
	if hb := m.GetHeartbeat(); hb != nil {
		g.heartbeats = append(g.heartbeats, proto.Clone(hb).(*agentv1.Heartbeat))
	}
	if h := m.GetHello(); h != nil {
		g.hellos = append(g.hellos, proto.Clone(h).(*agentv1.Hello))
		if g.hello != nil {
			h = proto.Clone(h).(*agentv1.Hello)
			g.hello(h)
			return &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: h}}
		}
	}
	return m
}

func (r *evilRelay) Connect(ctx context.Context, down *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	g := r.g
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	der, _ := ctx.Value(peerCertKey{}).([]byte)
	up := r.up.Connect(ctx)
	g.mu.Lock()
	behind := g.behind
	g.mu.Unlock()
	if behind {
		for k, v := range down.RequestHeader() {
			if strings.HasPrefix(k, wire.PeerHeaderPrefix) {
				up.RequestHeader()[k] = v
			}
		}
	} else {
		up.RequestHeader().Set(wire.PeerAddrHeader, "192.0.2.66:1")
		wire.SetPeerCertificate(up.RequestHeader(), der)
	}
	_ = up.Send(nil)
	defer func() { _ = up.CloseResponse() }()
	g.mu.Lock()
	g.upstreams++
	g.mu.Unlock()
	go func() {
		defer cancel()
		for {
			m, err := down.Receive()
			if err != nil {
				_ = up.CloseRequest()
				return
			}
			if m = g.upward(m); m == nil {
				continue
			}
			if res := m.GetResult(); res != nil {
				g.mu.Lock()
				n := len(g.results)
				g.results = append(g.results, proto.Clone(res).(*agentv1.CommandResult))
				tamper := g.tamper
				g.mu.Unlock()
				if tamper != nil {
					r := tamper(n, res)
					if r == nil {
						continue // dropped
					}
					m = &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: r}}
				}
			}
			if err := up.Send(m); err != nil {
				return
			}
		}
	}()
	for {
		m, err := up.Receive()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err // the API's answer, as the real gateway passes it
		}
		g.mu.Lock()
		drop, inject, shift, rewrite := g.drop, g.inject, g.welcomeShift, g.welcome
		if w := m.GetWelcome(); w != nil && (shift != 0 || rewrite != nil) {
			w = proto.Clone(w).(*agentv1.Welcome)
			w.ServerTimeUnixMs = time.UnixMilli(w.GetServerTimeUnixMs()).Add(shift).UnixMilli()
			if rewrite != nil {
				rewrite(w)
			}
			m = &agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: w}}
		}
		if c := m.GetChallenge(); c != nil {
			g.nonce = c.GetNonce()
		}
		if c := m.GetCommand(); c != nil {
			g.captured = append(g.captured, proto.Clone(c).(*agentv1.SignedCommand))
		}
		g.mu.Unlock()
		if m.GetCommand() != nil && drop {
			continue
		}
		if err := down.Send(m); err != nil {
			return nil
		}
		if m.GetWelcome() != nil {
			for _, c := range inject {
				if err := down.Send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: c}}); err != nil {
					return nil
				}
			}
		}
	}
}
