package bcdcmd_test

import (
	"context"
	"crypto/tls"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	bcdjointest "github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/tracing/tracingtest"
)

// R17.3: one join through the gateway is one trace: bcd's client span is
// the parent of the gateway's server span, whose relay's client span is
// the parent of the API's server span, whose join transaction is a
// store.tx span under it. Each process has its own provider.
func TestJoinIsOneTraceR17_3(t *testing.T) {
	bcd, gw, apiP := tracingtest.New(t, tracing.ServiceBCD), tracingtest.New(t, tracing.ServiceGateway), tracingtest.New(t, tracing.ServiceAPI)
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{Tracer: apiP.TP})
	gatewayURL := startGateway(t, e, gw.TP)
	token, cfg, configPath := bcdConfig(t, e, gatewayURL)

	keys, st, err := tpmkeys.Stores(cfg, cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	httpClient := func(c *tls.Config) *http.Client {
		return tracing.Client(bcd.TP, &http.Client{Transport: &http.Transport{TLSClientConfig: c, ForceAttemptHTTP2: true}})
	}
	j, err := enroll.New(enroll.Config{BCD: cfg, ConfigPath: configPath, Store: st, Keys: keys, HTTPClient: httpClient, Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	// bcd's command opens a root span around the join, as a trace would
	// start in a daemon.
	ctx, root := bcd.TP.Tracer("test").Start(context.Background(), "bcd join")
	if _, err := j.Join(ctx, enroll.Options{Token: token}); err != nil {
		t.Fatalf("join: %v", err)
	}
	root.End()

	const join = "bettercompute.agent.v1.JoinService/Join"
	bcdJoin := onlySpan(t, bcd.Exp, join, trace.SpanKindClient)
	gwServer := onlySpan(t, gw.Exp, join, trace.SpanKindServer)
	gwClient := onlySpan(t, gw.Exp, join, trace.SpanKindClient)
	apiServer := onlySpan(t, apiP.Exp, join, trace.SpanKindServer)
	var tx tracetest.SpanStub
	for _, s := range apiP.Exp.GetSpans() {
		if s.Name == tracing.SpanStoreTx && s.Parent.SpanID() == apiServer.SpanContext.SpanID() {
			tx = s
		}
	}
	if !tx.SpanContext.IsValid() {
		t.Fatalf("no store.tx span under the API's Join span; API spans: %v", names(apiP.Exp))
	}
	chain := []tracetest.SpanStub{bcdJoin, gwServer, gwClient, apiServer, tx}
	for i, s := range chain {
		if s.SpanContext.TraceID() != root.SpanContext().TraceID() {
			t.Errorf("%s (%v): trace %s, want %s", s.Name, s.SpanKind, s.SpanContext.TraceID(), root.SpanContext().TraceID())
		}
		if i > 0 && s.Parent.SpanID() != chain[i-1].SpanContext.SpanID() {
			t.Errorf("%s (%v): parent %s, want %s (%s)", s.Name, s.SpanKind, s.Parent.SpanID(), chain[i-1].SpanContext.SpanID(), chain[i-1].Name)
		}
	}
	for _, c := range []struct {
		p    tracingtest.Process
		want string
	}{{bcd, tracing.ServiceBCD}, {gw, tracing.ServiceGateway}, {apiP, tracing.ServiceAPI}} {
		if got := serviceOf(c.p.Exp.GetSpans()[0]); got != c.want {
			t.Errorf("service.name %q, want %q", got, c.want)
		}
	}
}

func onlySpan(t *testing.T, exp *tracetest.InMemoryExporter, name string, kind trace.SpanKind) tracetest.SpanStub {
	t.Helper()
	var found []tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.Name == name && s.SpanKind == kind {
			found = append(found, s)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d %v spans named %s, want 1; spans: %v", len(found), kind, name, names(exp))
	}
	return found[0]
}

func names(exp *tracetest.InMemoryExporter) []string {
	var n []string
	for _, s := range exp.GetSpans() {
		n = append(n, s.Name+"/"+s.SpanKind.String())
	}
	return n
}

func serviceOf(s tracetest.SpanStub) string {
	for _, kv := range s.Resource.Attributes() {
		if kv.Key == "service.name" {
			return kv.Value.AsString()
		}
	}
	return ""
}

// startGateway serves the API's agent listener and a gateway in front of
// it, tracing with tp; it returns the gateway's URL.
func startGateway(t *testing.T, e *apitest.Env, tp trace.TracerProvider) string {
	t.Helper()
	agent := apitest.StartAgent(t, e.Server.AgentHandler(), e.Bundle)
	dir := t.TempDir()
	gwPEM, gwKey, err := ca.IssueGateway(e.Bundle, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	g, err := gateway.New(gateway.Config{
		Listen: "127.0.0.1:0", CertFile: write("gateway.crt", gwPEM), KeyFile: write("gateway.key", gwKey),
		APIURL: agent.URL, APICAFile: write("serving-ca.pem", pki.CertPEM(e.Bundle.ServingCA)),
	}, gateway.Options{Log: quietLog(), Tracer: tp})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Serve(ln) }()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = g.Shutdown(sctx)
		<-done
	})
	return "https://" + ln.Addr().String()
}

// bcdConfig makes a site, a pool and a join token, and writes bcd's
// configuration as the install script does.
func bcdConfig(t *testing.T, e *apitest.Env, gatewayURL string) (token string, cfg *bcdconfig.Config, path string) {
	t.Helper()
	ctx := context.Background()
	site, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: site.Msg.Id, Name: "gpu", Agent: "bcd"}))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, TtlSeconds: 3600}))
	if err != nil {
		t.Fatal(err)
	}
	pins, err := e.Bundle.Pins()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(t.TempDir(), "host")
	cfg = &bcdconfig.Config{
		GatewayURL: gatewayURL, Site: site.Msg.Id,
		ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption,
		DataDir:   filepath.Join(root, "var", "lib", "bcd"),
		SysfsRoot: bcdjointest.FakeSysfs(t, filepath.Join(root, "sys")), ProcfsRoot: filepath.Join(root, "proc"),
		TPM: bcdconfig.TPM{Mode: bcdconfig.TPMOff},
	}
	etc := filepath.Join(root, "etc", "bcd")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	path = filepath.Join(etc, "config.toml")
	if err := cfg.Write(path); err != nil {
		t.Fatal(err)
	}
	if err := bcdconfig.WriteEncryptionKey(etc, pins.JoinEncryption, &e.Bundle.JoinEncryptionKey.PublicKey); err != nil {
		t.Fatal(err)
	}
	return tok.Msg.Token, cfg, path
}

func quietLog() *slog.Logger { return slog.New(slog.DiscardHandler) }
