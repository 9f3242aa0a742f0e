package gateway_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// logBuf collects a gateway's log lines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) { l.mu.Lock(); defer l.mu.Unlock(); return l.b.Write(p) }
func (l *logBuf) String() string              { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

// replica is one API replica's agent listener (mTLS, HTTP/2) and how many
// joins reached it.
type replica struct {
	srv   *httptest.Server
	joins atomic.Int64
}

func startReplica(t *testing.T, srv *api.Server, b *ca.Bundle) *replica {
	t.Helper()
	r := &replica{}
	h := srv.AgentHandler()
	r.srv = apitest.StartAgent(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.URL.Path == agentv1connect.JoinServiceJoinProcedure {
			r.joins.Add(1)
		}
		h.ServeHTTP(w, req)
	}), b)
	return r
}

// R4.9: a gateway over two real API replicas (two api.Servers on
// one database) spreads joins over both; when one stops, every join still
// succeeds (a join that met the dead replica is retried on the other,
// which is safe because a join asked again gets its stored answer), the
// gateway takes the dead one out by its health checks, and a join request
// sent again through the gateway gets the identical answer from whichever
// replica it reaches.
func TestGatewayOverReplicas(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		srv2, err := api.New(api.Config{DB: e.DB, Bundle: e.Bundle})
		if err != nil {
			t.Fatal(err)
		}
		r1, r2 := startReplica(t, e.Server, e.Bundle), startReplica(t, srv2, e.Bundle)

		tok, poolID := createToken(t, e, 100)

		write := fileWriter(t)
		gwPEM, gwKey, err := ca.IssueGateway(e.Bundle, []string{"127.0.0.1"}, time.Now(), time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		logs := &logBuf{}
		g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: write("gw.crt", gwPEM), KeyFile: write("gw.key", gwKey),
			APIURLs: []string{r1.srv.URL, r2.srv.URL}, APICAFile: write("ca.pem", pki.CertPEM(e.Bundle.ServingCA))},
			gateway.Options{Log: slog.New(slog.NewTextHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		gwAddr := apitest.ServeGateway(t, g)
		roots := x509.NewCertPool()
		roots.AddCert(e.Bundle.ServingCA)
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}
		t.Cleanup(tr.CloseIdleConnections)
		daemon := agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, "https://"+gwAddr, connect.WithGRPC())
		machine := 0
		join := func(req *agentv1.JoinRequest) *agentv1.JoinResponse {
			t.Helper()
			res, err := daemon.Join(ctx, connect.NewRequest(req))
			if err != nil {
				t.Fatalf("join through the gateway: %v", err)
			}
			return res.Msg
		}
		joinNew := func(n int) {
			t.Helper()
			for range n {
				machine++
				join(jointest.NewMachine(t, jointest.Claims(90000+machine)).Request(t, e.Bundle, tok.Token, ""))
			}
		}

		joinNew(10)
		if r1.joins.Load() == 0 || r2.joins.Load() == 0 {
			t.Fatalf("joins per replica %d and %d: want both used", r1.joins.Load(), r2.joins.Load())
		}

		// One request, then the same request again, lands on both.
		m := jointest.NewMachine(t, jointest.Claims(99999))
		req := m.Request(t, e.Bundle, tok.Token, "")
		first := join(req)
		again := join(proto.Clone(req).(*agentv1.JoinRequest))
		if !proto.Equal(first, again) {
			t.Fatal("the same join request sent again got another answer")
		}

		// Replica 2 stops; joins go on without an error.
		r2.srv.Close()
		before := r1.joins.Load()
		joinNew(10)
		if r1.joins.Load()-before != 10 {
			t.Errorf("replica 1 got %d of 10 joins after replica 2 stopped", r1.joins.Load()-before)
		}
		// The health checks take it out (within healthEvery +
		// healthTimeout, under a second, by construction).
		poll.UntilDetail(t, 10*time.Second, func() string { return "the gateway to take the stopped replica out; log:\n" + logs.String() },
			func() bool { return strings.Contains(logs.String(), "API replica out") })
		// Every use spent was a join that succeeded: 10 + 1 + 10, none
		// twice for the request sent again.
		tokens, err := e.Admin.JoinTokens.ListJoinTokens(ctx, connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: e.RootTenant, PoolId: poolID}))
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, jt := range tokens.Msg.GetItems() {
			if jt.GetId() == tok.Id {
				found = true
				if jt.GetUsesLeft() != 100-21 {
					t.Errorf("uses left %d, want %d", jt.GetUsesLeft(), 100-21)
				}
			}
		}
		if !found {
			t.Error("the token is not listed")
		}
	})
}
