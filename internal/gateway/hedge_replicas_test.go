package gateway_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// heldWriter holds a response's headers (and so its whole answer) until
// release is closed: the API has done the call's work, committed
// included, but the gateway hears nothing, as behind a stalled proxy.
type heldWriter struct {
	http.ResponseWriter
	committed chan<- struct{}
	release   <-chan struct{}
	held      bool
}

func (w *heldWriter) hold() {
	if !w.held {
		w.held = true
		w.committed <- struct{}{}
		<-w.release
	}
}

func (w *heldWriter) WriteHeader(code int)        { w.hold(); w.ResponseWriter.WriteHeader(code) }
func (w *heldWriter) Write(b []byte) (int, error) { w.hold(); return w.ResponseWriter.Write(b) }
func (w *heldWriter) Flush() {
	w.hold()
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
func (w *heldWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// R19.2 with real API replicas (two api.Servers on one database): the
// first join reaches a replica that commits it and then stalls before
// answering; after attempt_timeout the gateway resends the same bytes to
// the other replica, which answers with the stored answer of that very
// join (R4.9). The machine is told it joined, one use is spent, one node
// is made, and the stalled replica's late answer, once released, changes
// nothing: the same request asked again gets the identical answer.
func TestStalledReplicaCommittedJoinR19_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		srv2, err := api.New(api.Config{DB: e.DB, Bundle: e.Bundle})
		if err != nil {
			t.Fatal(err)
		}
		var stallNext atomic.Bool
		stallNext.Store(true)
		committed, release := make(chan struct{}, 1), make(chan struct{})
		stalling := func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == agentv1connect.JoinServiceJoinProcedure && stallNext.CompareAndSwap(true, false) {
					w = &heldWriter{ResponseWriter: w, committed: committed, release: release}
				}
				h.ServeHTTP(w, r)
			})
		}
		r1 := apitest.StartAgent(t, stalling(e.Server.AgentHandler()), e.Bundle)
		r2 := apitest.StartAgent(t, stalling(srv2.AgentHandler()), e.Bundle)
		t.Cleanup(func() { close(release) }) // before the servers close

		tok, poolID := createToken(t, e, 10)

		write := fileWriter(t)
		gwPEM, gwKey, err := ca.IssueGateway(e.Bundle, []string{"127.0.0.1"}, time.Now(), time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		const attemptTimeout = 5 * time.Second
		clk := clock.NewFake(time.Now())
		g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: write("gw.crt", gwPEM), KeyFile: write("gw.key", gwKey),
			APIURLs: []string{r1.URL, r2.URL}, APICAFile: write("ca.pem", pki.CertPEM(e.Bundle.ServingCA)), AttemptTimeout: attemptTimeout},
			gateway.Options{Log: slog.New(slog.DiscardHandler), Clock: clk})
		if err != nil {
			t.Fatal(err)
		}
		gwAddr := apitest.ServeGateway(t, g)
		roots := x509.NewCertPool()
		roots.AddCert(e.Bundle.ServingCA)
		tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}
		t.Cleanup(tr.CloseIdleConnections)
		daemon := agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, "https://"+gwAddr, connect.WithGRPC())

		req := jointest.NewMachine(t, jointest.Claims(77001)).Request(t, e.Bundle, tok.Token, "")
		type result struct {
			res *agentv1.JoinResponse
			err error
		}
		done := make(chan result, 1)
		go func() {
			res, err := daemon.Join(ctx, connect.NewRequest(req))
			if err != nil {
				done <- result{err: err}
				return
			}
			done <- result{res: res.Msg}
		}()
		select {
		case <-committed: // the first replica did the join and holds its answer
		case <-time.After(20 * time.Second):
			t.Fatal("the join never reached a replica")
		}
		countNodes := func() int {
			t.Helper()
			nodes, err := e.Admin.Nodes.ListNodes(ctx, connect.NewRequest(&bcv1.ListNodesRequest{TenantId: e.RootTenant}))
			if err != nil {
				t.Fatal(err)
			}
			return len(nodes.Msg.GetItems())
		}
		if n := countNodes(); n != 1 {
			t.Fatalf("%d nodes while the first replica holds its answer, want 1: the join committed", n)
		}
		clk.Advance(attemptTimeout)
		var first result
		select {
		case first = <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("no answer after the attempt deadline")
		}
		if first.err != nil {
			t.Fatalf("the machine was told %v after its join committed", first.err)
		}
		again, err := daemon.Join(ctx, connect.NewRequest(proto.Clone(req).(*agentv1.JoinRequest)))
		if err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(first.res, again.Msg) {
			t.Error("the same join request asked again got another answer")
		}
		tokens, err := e.Admin.JoinTokens.ListJoinTokens(ctx, connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: e.RootTenant, PoolId: poolID}))
		if err != nil {
			t.Fatal(err)
		}
		for _, jt := range tokens.Msg.GetItems() {
			if jt.GetId() == tok.Id && jt.GetUsesLeft() != 9 {
				t.Errorf("uses left %d, want 9: one join, resent, spends one use", jt.GetUsesLeft())
			}
		}
		if n := countNodes(); n != 1 {
			t.Errorf("%d nodes, want 1", n)
		}
	})
}
