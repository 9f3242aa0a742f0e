package gateway

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

func joinRequest(token string) *agentv1.JoinRequest {
	return &agentv1.JoinRequest{
		SealedToken: token,
		Csr:         []byte{0x30, 0x82, 0x00, 0xff, 0x00, 0x0a, 0x0d, 0x80},
		Claims: &agentv1.Claims{
			ProductUuid: "4c4c4544-0042-3510-8052-b7c04f4d3732", ProductSerial: "SN-7701",
			Macs: []string{"00:11:22:33:44:55"}, GpuUuids: []string{"GPU-1"}, Hostname: "rack-b7-u12",
		},
		Role:     "node",
		NodeId:   "node_01",
		Protocol: 1,
	}
}

func TestJoinRelayed(t *testing.T) { onBothServers(t, testJoinRelayed) }

func testJoinRelayed(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	_, gw := startGateway(t, e.config(f.URL()))

	tests := []struct {
		name  string
		certs bool // the daemon presents a client certificate
		spoof bool // the daemon sends its own Bc-Peer-* headers
	}{
		{name: "plain"},
		{name: "spoofed peer headers", spoof: true},
		{name: "client certificate is not forwarded on join", certs: true, spoof: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var d *daemon
			if tc.certs {
				d = newDaemon(t, e, gw, e.nodeCert(t, "node_01"))
			} else {
				d = newDaemon(t, e, gw)
			}
			sent := joinRequest("eyJhbGciOiJFQ0RILUVTK0EyNTZLVyJ9.a.b.c.d")
			req := connect.NewRequest(sent)
			if tc.spoof {
				req.Header().Set(wire.PeerAddrHeader, "10.6.6.6:1")
				req.Header().Set(wire.PeerCertificateHeader, "AAAA")
				req.Header().Set("Bc-Peer-Tenant", "root")
			}
			res, err := d.client.Join(context.Background(), req)
			if err != nil {
				t.Fatalf("join: %v", err)
			}
			if !bytes.Equal(res.Msg.Body, fakeBody) || !bytes.Equal(res.Msg.Sig, fakeSig) {
				t.Errorf("the answer changed on the way: body %x sig %x", res.Msg.Body, res.Msg.Sig)
			}
			got := f.last(t)
			if !proto.Equal(got.join, sent) {
				t.Errorf("the API got %v, want %v", got.join, sent)
			}
			if !bytes.Equal(got.join.Csr, sent.Csr) || got.join.SealedToken != sent.SealedToken {
				t.Errorf("seal or CSR changed on the way")
			}
			if a := got.header.Get(wire.PeerAddrHeader); a != d.addr() || a == "" {
				t.Errorf("%s = %q, want the daemon's address %q", wire.PeerAddrHeader, a, d.addr())
			}
			if v := got.header.Values(wire.PeerAddrHeader); len(v) != 1 {
				t.Errorf("%s has %d values, want 1", wire.PeerAddrHeader, len(v))
			}
			for k := range got.header {
				if strings.HasPrefix(k, "Bc-Peer-") && k != wire.PeerAddrHeader {
					t.Errorf("the API got header %s = %q from the daemon", k, got.header.Get(k))
				}
			}
			if n := f.violations.Load(); n != 0 {
				t.Errorf("%d calls reached the API without HTTP/2 or the gateway's identity", n)
			}
		})
	}
}

func TestRenewForwardsPeerCertificate(t *testing.T) {
	onBothServers(t, testRenewForwardsPeerCertificate)
}

func testRenewForwardsPeerCertificate(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	_, gw := startGateway(t, e.config(f.URL()))
	nodeCert := e.nodeCert(t, "node_01")

	tests := []struct {
		name     string
		certs    bool
		spoof    bool
		nodeID   string
		wantCert bool
		wantCode errs.Code
	}{
		{name: "with a node certificate", certs: true, nodeID: "node_01", wantCert: true},
		{name: "spoofed header replaced", certs: true, spoof: true, nodeID: "node_01", wantCert: true},
		{name: "no certificate, spoofed header dropped", spoof: true, nodeID: "node_01"},
		{name: "refusal passes through", certs: true, nodeID: "refuse", wantCert: true, wantCode: errs.AccessDenied},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var d *daemon
			if tc.certs {
				d = newDaemon(t, e, gw, nodeCert)
			} else {
				d = newDaemon(t, e, gw)
			}
			sent := &agentv1.RenewRequest{Csr: []byte{1, 2, 3}, Chain: [][]byte{nodeCert.Certificate[0]}, ClientTimeUnixMs: 1700000000000, PopSig: []byte{9, 8, 7}, NodeId: tc.nodeID}
			req := connect.NewRequest(sent)
			if tc.spoof {
				forged := e.nodeCert(t, "node_evil")
				req.Header().Set(wire.PeerCertificateHeader, base64.StdEncoding.EncodeToString(forged.Certificate[0]))
				req.Header().Set(wire.PeerAddrHeader, "10.6.6.6:1")
			}
			res, err := d.client.Renew(context.Background(), req)
			if tc.wantCode != "" {
				pe := productError(t, err)
				if pe.Code != tc.wantCode || pe.Message != "Renew refused" {
					t.Fatalf("got %s %q, want %s \"Renew refused\"", pe.Code, pe.Message, tc.wantCode)
				}
			} else {
				if err != nil {
					t.Fatalf("renew: %v", err)
				}
				if !bytes.Equal(res.Msg.Body, fakeBody) || !bytes.Equal(res.Msg.Sig, fakeSig) {
					t.Errorf("the answer changed on the way")
				}
			}
			got := f.last(t)
			if !proto.Equal(got.renew, sent) {
				t.Errorf("the API got %v, want %v", got.renew, sent)
			}
			if a := got.header.Get(wire.PeerAddrHeader); a != d.addr() {
				t.Errorf("%s = %q, want %q", wire.PeerAddrHeader, a, d.addr())
			}
			h := got.header.Values(wire.PeerCertificateHeader)
			if !tc.wantCert {
				if len(h) != 0 {
					t.Fatalf("%s = %q, want none", wire.PeerCertificateHeader, h)
				}
				return
			}
			if len(h) != 1 {
				t.Fatalf("%s has %d values, want 1", wire.PeerCertificateHeader, len(h))
			}
			der, err := base64.StdEncoding.DecodeString(h[0])
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(der, nodeCert.Certificate[0]) {
				t.Fatalf("%s is not the presented leaf", wire.PeerCertificateHeader)
			}
			if id, err := pki.ParseNodeCert(der); err != nil || id.NodeID != "node_01" {
				t.Fatalf("ParseNodeCert: %v %v", id, err)
			}
		})
	}
}

func TestUpstreamErrorsPassThrough(t *testing.T) { onBothServers(t, testUpstreamErrorsPassThrough) }

func testUpstreamErrorsPassThrough(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	_, gw := startGateway(t, e.config(f.URL()))
	d := newDaemon(t, e, gw)

	tests := []struct {
		token     string
		wantCode  errs.Code
		wantMsg   string
		wantField string
	}{
		{"refuse", errs.AccessDenied, "Join refused", ""},
		{"conflict", errs.Conflict, "This machine joined concurrently; retry", ""},
		{"bad-csr", errs.InvalidArgument, "csr: not a PKCS#10 request", "csr"},
		{"no-pki", errs.InvalidConfig, "JoinService is not configured", ""},
	}
	for _, tc := range tests {
		t.Run(tc.token, func(t *testing.T) {
			_, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest(tc.token)))
			pe := productError(t, err)
			if pe.Code != tc.wantCode || pe.Message != tc.wantMsg || pe.Field != tc.wantField {
				t.Fatalf("got %s %q field %q, want %s %q field %q", pe.Code, pe.Message, pe.Field, tc.wantCode, tc.wantMsg, tc.wantField)
			}
		})
	}
}

func TestGatewayRefusals(t *testing.T) { onBothServers(t, testGatewayRefusals) }

func testGatewayRefusals(t *testing.T, e *env) {
	f := newFakeAPI(t, e)

	// An API that is down: it drops every connection. (The listener stays
	// open, so no other process can take the port meanwhile.)
	downURL := "https://" + droppingListener(t)

	// An API whose certificate the serving CA does not verify: the
	// gateway must not talk to it.
	other := newEnv(t)
	impostor := newFakeAPI(t, other)

	tests := []struct {
		name     string
		apiURL   string
		req      *agentv1.JoinRequest
		wantCode errs.Code
		wantMsg  string
	}{
		{"API down", downURL, joinRequest("t"), errs.Unavailable, "the control plane is unavailable; retry later"},
		{"API not from the serving CA", impostor.URL(), joinRequest("t"), errs.Unavailable, "the control plane is unavailable; retry later"},
		{"oversized body", f.URL(), joinRequest(strings.Repeat("a", DefaultMaxBodyBytes+1)), errs.ResourcesLimited, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := f.count()
			_, gw := startGateway(t, e.config(tc.apiURL))
			d := newDaemon(t, e, gw)
			_, err := d.client.Join(context.Background(), connect.NewRequest(tc.req))
			pe := productError(t, err)
			if pe.Code != tc.wantCode || (tc.wantMsg != "" && pe.Message != tc.wantMsg) {
				t.Fatalf("got %s %q, want %s %q", pe.Code, pe.Message, tc.wantCode, tc.wantMsg)
			}
			if f.count() != before || impostor.count() != 0 {
				t.Fatalf("the call reached an API")
			}
		})
	}
}

func TestBusyRefusedAtOnce(t *testing.T) { onBothServers(t, testBusyRefusedAtOnce) }

func testBusyRefusedAtOnce(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	cfg := e.config(f.URL())
	cfg.MaxConcurrent = 1
	_, gw := startGateway(t, cfg)
	d := newDaemon(t, e, gw)

	first := make(chan error, 1)
	go func() {
		_, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest("block")))
		first <- err
	}()
	select {
	case <-f.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the first call never reached the API")
	}
	start := time.Now()
	_, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest("t")))
	pe := productError(t, err)
	if pe.Code != errs.ResourcesLimited || pe.Message != "the gateway is busy; retry later" {
		t.Fatalf("got %s %q, want RESOURCE_EXHAUSTED", pe.Code, pe.Message)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("the refusal took %s", el)
	}
	close(f.block)
	if err := <-first; err != nil {
		t.Fatalf("the held call: %v", err)
	}
	// The slot is free again.
	if _, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest("t"))); err != nil {
		t.Fatalf("after release: %v", err)
	}
}

func TestRequestTimeout(t *testing.T) { onBothServers(t, testRequestTimeout) }

func testRequestTimeout(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	cfg := e.config(f.URL())
	cfg.RequestTimeout = 200 * time.Millisecond
	_, gw := startGateway(t, cfg)
	d := newDaemon(t, e, gw)
	defer close(f.block)
	_, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest("block")))
	<-f.entered
	pe := productError(t, err)
	if pe.Code != errs.Unavailable {
		t.Fatalf("got %s %q, want UNAVAILABLE", pe.Code, pe.Message)
	}
}

func TestUpstreamConnectionsReused(t *testing.T) { onBothServers(t, testUpstreamConnectionsReused) }

func testUpstreamConnectionsReused(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	_, gw := startGateway(t, e.config(f.URL()))
	// A new daemon connection for some calls, so reuse upstream does not
	// depend on one daemon connection.
	shared := newDaemon(t, e, gw)
	for i := range 50 {
		d := shared
		if i%2 == 0 {
			d = newDaemon(t, e, gw)
		}
		if _, err := d.client.Join(context.Background(), connect.NewRequest(joinRequest("t"))); err != nil {
			t.Fatalf("join %d: %v", i, err)
		}
	}
	if n := f.count(); n != 50 {
		t.Fatalf("the API saw %d calls, want 50", n)
	}
	t.Logf("50 relays, %d upstream connections", f.conns.Load())
	if n := f.conns.Load(); n > 2 {
		t.Fatalf("50 relays opened %d upstream connections, want at most 2", n)
	}
	if n := f.violations.Load(); n != 0 {
		t.Fatalf("%d calls without HTTP/2 or the gateway's identity", n)
	}
}

func TestRunServesAndStops(t *testing.T) { onBothServers(t, testRunServesAndStops) }

func testRunServesAndStops(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	// Run listens on port 0 and reports the port it took.
	ready := make(chan string, 1)
	g, err := New(e.config(f.URL()), Options{Log: quietLog(), Ready: func(a string) { ready <- a }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- g.Run(ctx) }()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("Run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not listen")
	}
	d := newDaemon(t, e, addr)
	poll.UntilDetail(t, 5*time.Second, func() string { return fmt.Sprintf("a join through Run (last: %v)", err) }, func() bool {
		_, err = d.client.Join(context.Background(), connect.NewRequest(joinRequest("t")))
		return err == nil
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after ctx ended")
	}
}

func BenchmarkRelayJoin(b *testing.B) { benchmarkRelayJoin(b, nil, false) }

// BenchmarkRelayJoinTraced is BenchmarkRelayJoin with tracing on: every
// relay records a server and a client span (exported to nowhere).
func BenchmarkRelayJoinTraced(b *testing.B) {
	tp := tracing.NewProvider(tracing.Config{}, tracing.ServiceGateway, sdktrace.WithSyncer(tracetest.NewNoopExporter()))
	b.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	benchmarkRelayJoin(b, tp, false)
}

// benchmarkRelayJoin relays joins to the fake API over mTLS, or, local,
// to its handler in memory (a gateway in the API's process).
func benchmarkRelayJoin(b *testing.B, tp trace.TracerProvider, local bool) {
	e := newEnv(b)
	f := newFakeAPI(b, e)
	cfg, o := e.config(f.URL()), Options{Log: quietLog(), Tracer: tp}
	if local {
		path, h := agentv1connect.NewJoinServiceHandler(f)
		mux := http.NewServeMux()
		mux.Handle(path, h)
		cfg, o.LocalAPI = e.localConfig(), mux
	}
	_, gw := startGatewayWith(b, cfg, o)
	d := newDaemon(b, e, gw)
	req := joinRequest("eyJhbGciOiJFQ0RILUVTK0EyNTZLVyJ9.a.b.c.d")
	// Warm both connections.
	if _, err := d.client.Join(context.Background(), connect.NewRequest(req)); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	runtime.GC()
	b.ResetTimer()
	cpu := processCPU(b)
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := d.client.Join(context.Background(), connect.NewRequest(req)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	// The test process's CPU per relay (daemon client, gateway and fake
	// API together): on a shared machine wall time mostly measures the
	// neighbours.
	b.ReportMetric(float64((processCPU(b)-cpu).Microseconds())/float64(b.N), "cpu-us/op")
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "relays/s")
	b.ReportMetric(float64(f.conns.Load()), "upstream-conns")
}

// processCPU is the test process's CPU time so far (user and system).
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// R4.1: a join is relayed unchanged whatever codec and protocol the daemon
// speaks. Binary calls are relayed as bytes (fields this gateway does not
// know arrive too); JSON calls are decoded and re-encoded.
func TestJoinRelayedEveryCodec(t *testing.T) { onBothServers(t, testJoinRelayedEveryCodec) }

func testJoinRelayedEveryCodec(t *testing.T, e *env) {
	f := newFakeAPI(t, e)
	_, gw := startGateway(t, e.config(f.URL()))
	sent := joinRequest("eyJhbGciOiJFQ0RILUVTK0EyNTZLVyJ9.a.b.c.d")
	withUnknown := proto.Clone(sent).(*agentv1.JoinRequest)
	// Field 999, varint 7: a field of a newer daemon.
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 999, protowire.VarintType), 7))
	tests := []struct {
		name  string
		opts  []connect.ClientOption
		http1 bool
		req   *agentv1.JoinRequest
	}{
		{name: "gRPC", opts: []connect.ClientOption{connect.WithGRPC()}, req: sent},
		{name: "gRPC, an unknown field", opts: []connect.ClientOption{connect.WithGRPC()}, req: withUnknown},
		{name: "gRPC-Web", opts: []connect.ClientOption{connect.WithGRPCWeb()}, req: sent},
		{name: "Connect", req: sent},
		{name: "Connect JSON", opts: []connect.ClientOption{connect.WithProtoJSON()}, req: sent},
		{name: "gRPC JSON", opts: []connect.ClientOption{connect.WithGRPC(), connect.WithProtoJSON()}, req: sent},
		// HTTP/1.1 (curl, scripts): net/http serves it on either server.
		{name: "Connect over HTTP/1.1", http1: true, req: sent},
		{name: "gRPC-Web over HTTP/1.1", opts: []connect.ClientOption{connect.WithGRPCWeb()}, http1: true, req: sent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := newDaemon(t, e, gw)
			hc := &http.Client{Transport: d.tr}
			if tc.http1 {
				d.tr.ForceAttemptHTTP2 = false
				d.tr.Protocols = new(http.Protocols)
				d.tr.Protocols.SetHTTP1(true)
				hc.Transport = &protoCheck{rt: d.tr, t: t, major: 1}
			}
			c := agentv1connect.NewJoinServiceClient(hc, "https://"+gw, tc.opts...)
			res, err := c.Join(context.Background(), connect.NewRequest(tc.req))
			if err != nil {
				t.Fatalf("join: %v", err)
			}
			if !bytes.Equal(res.Msg.Body, fakeBody) || !bytes.Equal(res.Msg.Sig, fakeSig) {
				t.Errorf("the answer changed on the way: body %x sig %x", res.Msg.Body, res.Msg.Sig)
			}
			if got := f.last(t); !proto.Equal(got.join, tc.req) {
				t.Errorf("the API got %v, want %v", got.join, tc.req)
			}
			// A refusal passes through every protocol with its product code.
			_, err = c.Join(context.Background(), connect.NewRequest(joinRequest("refuse")))
			if pe := productError(t, err); pe.Code != errs.AccessDenied {
				t.Errorf("refusal: got %v, want ACCESS_DENIED", pe)
			}
		})
	}
}

// protoCheck fails the test on an answer over another HTTP version.
type protoCheck struct {
	rt    http.RoundTripper
	t     *testing.T
	major int
}

func (p *protoCheck) RoundTrip(r *http.Request) (*http.Response, error) {
	res, err := p.rt.RoundTrip(r)
	if err == nil && res.ProtoMajor != p.major {
		p.t.Errorf("answered over %s, want HTTP/%d", res.Proto, p.major)
	}
	return res, err
}
