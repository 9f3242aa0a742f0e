package loadgen_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/tools/loadgen"
)

// target is the real control plane in-process: the API with its agent
// listener (mTLS, the serving CA), a real gateway in front of it, a bcd
// config.toml with join-encryption.jwk beside it, and a token.
type target struct {
	e          *apitest.Env
	configPath string
	token      string
	gw         *gatewayProc
}

// gatewayProc is the target's gateway, which a test may restart on the
// same address.
type gatewayProc struct {
	cfg  gateway.Config
	g    *gateway.Gateway
	ln   net.Listener
	done chan error
}

func (p *gatewayProc) start(t *testing.T, addr string) {
	t.Helper()
	g, err := gateway.New(p.cfg, gateway.Options{Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	p.g, p.ln, p.done = g, ln, make(chan error, 1)
	go func() { p.done <- g.Serve(ln) }()
}

// stop shuts the gateway down: its sessions end.
func (p *gatewayProc) stop() {
	if p.g == nil {
		return
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = p.g.Shutdown(sctx)
	<-p.done
	p.g = nil
}

// restart stops the gateway and starts a new one on the same address.
func (p *gatewayProc) restart(t *testing.T) {
	t.Helper()
	addr := p.ln.Addr().String()
	p.stop()
	p.start(t, addr)
}

func newTarget(t *testing.T, e *apitest.Env, uses int32) *target {
	t.Helper()
	ctx := context.Background()
	b := e.Bundle
	now := time.Now()
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}

	apiPEM, apiKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	apiPair, err := tls.X509KeyPair(apiPEM, apiKey)
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AddCert(b.ServingCA)
	srv := httptest.NewUnstartedServer(e.Server.AgentHandler())
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{apiPair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	gwPEM, gwKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	gw := &gatewayProc{cfg: gateway.Config{
		Listen: "127.0.0.1:0", CertFile: write("gateway.crt", gwPEM), KeyFile: write("gateway.key", gwKey),
		APIURL: srv.URL, APICAFile: write("serving-ca.pem", pki.CertPEM(b.ServingCA)),
	}}
	gw.start(t, "127.0.0.1:0")
	t.Cleanup(func() { gw.stop() })
	ln := gw.ln

	site, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: site.Msg.Id, Name: "gpu", Agent: "bcd"}))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, TtlSeconds: 3600, MaxUses: uses}))
	if err != nil {
		t.Fatal(err)
	}
	pins, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	cfg := &bcdconfig.Config{
		GatewayURL: "https://" + ln.Addr().String(), Site: site.Msg.Id,
		ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption,
	}
	tg := &target{e: e, configPath: filepath.Join(dir, "bcd", "config.toml"), token: tok.Msg.Token, gw: gw}
	if err := os.MkdirAll(filepath.Dir(tg.configPath), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := cfg.Write(tg.configPath); err != nil {
		t.Fatal(err)
	}
	if err := bcdconfig.WriteEncryptionKey(filepath.Dir(tg.configPath), pins.JoinEncryption, &b.JoinEncryptionKey.PublicKey); err != nil {
		t.Fatal(err)
	}
	return tg
}

// certsPerNode counts node_certs rows per node.
func certsPerNode(t *testing.T, e *apitest.Env) map[string]int {
	t.Helper()
	ctx := context.Background()
	out := map[string]int{}
	err := e.DB.ReadTx(ctx, func(tx *store.Tx) error {
		nodes, err := tx.ListNodes(ctx, e.RootTenant, "", "", 1000)
		if err != nil {
			return err
		}
		for _, n := range nodes {
			certs, err := tx.ListNodeCerts(ctx, n.ID, 100)
			if err != nil {
				return err
			}
			out[n.ID] = len(certs)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestJoinMode(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		tg := newTarget(t, e, 20)
		for _, fresh := range []bool{true, false} {
			r, err := loadgen.Run(context.Background(), loadgen.Config{BCDConfig: tg.configPath, Token: tg.token, Machines: 8, Concurrency: 3,
				NewConnections: fresh, Verify: true, PIDs: map[string][]int{"self": {os.Getpid()}, "twice": {os.Getpid(), os.Getpid()}, "gone": {os.Getpid(), 1 << 30}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			// Every set of live processes gets a figure, a set with a
			// process that does not exist none. (The figures themselves
			// are TestCPUTimesSumsASet's: 8 joins take a few of /proc's
			// 10 ms ticks or none, too few to compare.)
			_, self := r.CPUmsPerJoin["self"]
			_, twice := r.CPUmsPerJoin["twice"]
			_, gone := r.CPUmsPerJoin["gone"]
			if r.Joined != 8 || r.Verified != 8 || r.Failed+r.Refused != 0 || r.Renew != nil || !self || !twice || gone {
				t.Fatalf("new connections %v: %+v", fresh, r)
			}
		}
	})
}

// Renew mode: every machine joins, then renews through the gateway with
// the real protocol; every answer verifies as bcd checks it, and every
// renewal is a node_certs row. With Resume each machine's first renewal
// resumes the TLS session of a call made with its certificate before the
// clock; its second, with the renewed certificate, is a full handshake
// (R13.2: tickets are per identity).
func TestRenewMode(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		tg := newTarget(t, e, 20)
		cases := []struct {
			fresh    bool
			renewals int
			resume   bool
		}{{true, 1, false}, {false, 3, false}, {true, 2, true}}
		for _, c := range cases {
			r, err := loadgen.Run(context.Background(), loadgen.Config{BCDConfig: tg.configPath, Token: tg.token, Machines: 6, Concurrency: 4,
				NewConnections: c.fresh, Mode: "renew", Renewals: c.renewals, Resume: c.resume, Verify: true, PIDs: map[string][]int{"self": {os.Getpid()}}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if r.Joined != 6 || r.Verified != 6 {
				t.Fatalf("join phase: %+v", r)
			}
			rr := r.Renew
			want := 6 * c.renewals
			if rr == nil || rr.Renewed != want || rr.Verified != want || rr.Refused+rr.Failed+rr.Skipped != 0 || rr.NewConnections != c.fresh ||
				rr.RenewalsPerSecond <= 0 || rr.P99ms <= 0 || rr.CPUmsPerRenewal["self"] <= 0 {
				t.Fatalf("renewals (new connections %v, %d each): %+v", c.fresh, c.renewals, rr)
			}
			if wantResumed := map[bool]int64{true: 6}[c.resume]; rr.Resume != c.resume || rr.Resumed != wantResumed {
				t.Fatalf("resume %v: %d connections resumed, want %d", rr.Resume, rr.Resumed, wantResumed)
			}
		}
		counts := map[int]int{}
		for _, n := range certsPerNode(t, e) {
			counts[n]++
		}
		if counts[2] != 6 || counts[4] != 6 || counts[3] != 6 || len(counts) != 3 {
			t.Fatalf("certificates per node: %v", counts)
		}
	})
}

func TestRenewModeRejectsBadArguments(t *testing.T) {
	for _, cfg := range []loadgen.Config{
		{Machines: 1, Concurrency: 1, Mode: "rekey"},
		{Machines: 1, Concurrency: 1, Mode: "renew", Renewals: -1},
		{Machines: 0, Concurrency: 1, Mode: "renew"},
	} {
		if _, err := loadgen.Run(context.Background(), cfg, nil); err == nil {
			t.Errorf("%+v: accepted", cfg)
		}
	}
}

func TestParsePIDs(t *testing.T) {
	got, err := loadgen.ParsePIDs("api=11+12,gateway=13")
	if err != nil || len(got) != 2 || len(got["api"]) != 2 || got["api"][0] != 11 || got["api"][1] != 12 || len(got["gateway"]) != 1 || got["gateway"][0] != 13 {
		t.Fatalf("got %v, %v", got, err)
	}
	for _, bad := range []string{"api", "api=", "api=x", "api=1+", "=1", "api=1,api=2", "api=-1", "api=1,"} {
		if _, err := loadgen.ParsePIDs(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
