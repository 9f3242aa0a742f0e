package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// hedgeReplica is an API replica's agent listener (mTLS, HTTP/2) whose
// joins and renewals all behave one way (its mode):
//   - "ok" answers at once with a body naming the replica;
//   - "stall" blocks until the test releases it, then answers "late-" and
//     its name;
//   - "reset" resets the stream before any answer;
//   - "refuse" refuses (ACCESS_DENIED).
//
// Its /readyz always answers 200, so health checks take none out.
type hedgeReplica struct {
	agentv1connect.UnimplementedJoinServiceHandler
	name, mode string
	srv        *httptest.Server
	calls      atomic.Int64
	entered    chan struct{}
	release    chan struct{}
	finished   atomic.Int64
}

func startHedgeReplica(t *testing.T, e *env, name, mode string) *hedgeReplica {
	t.Helper()
	r := &hedgeReplica{name: name, mode: mode, entered: make(chan struct{}, 8), release: make(chan struct{})}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewJoinServiceHandler(r))
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	r.srv = httptest.NewUnstartedServer(mux)
	r.srv.EnableHTTP2 = true
	r.srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{e.apiCert},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: e.roots}
	r.srv.Config.ErrorLog = slog.NewLogLogger(quietLog().Handler(), slog.LevelError)
	r.srv.StartTLS()
	t.Cleanup(r.srv.Close)
	// Cleanups run last first: a stalled call ends before Close waits on it.
	t.Cleanup(func() { close(r.release) })
	return r
}

// answer is the replica's answer body, or its error, per its mode.
func (r *hedgeReplica) answer(procedure string) ([]byte, error) {
	r.calls.Add(1)
	defer r.finished.Add(1)
	switch r.mode {
	case "stall":
		r.entered <- struct{}{}
		<-r.release // the caller's cancellation does not end it: the answer comes late
		return []byte("late-" + r.name), nil
	case "reset":
		panic(http.ErrAbortHandler) // net/http resets the stream
	case "refuse":
		return nil, wire.ToWire(quietLog(), procedure, errs.New(errs.AccessDenied, "Refused by %s", r.name))
	}
	return []byte(r.name), nil
}

func (r *hedgeReplica) Join(context.Context, *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
	b, err := r.answer(agentv1connect.JoinServiceJoinProcedure)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.JoinResponse{Body: b, Sig: fakeSig}), nil
}

func (r *hedgeReplica) Renew(context.Context, *connect.Request[agentv1.RenewRequest]) (*connect.Response[agentv1.RenewResponse], error) {
	b, err := r.answer(agentv1connect.JoinServiceRenewProcedure)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.RenewResponse{Body: b, Sig: fakeSig}), nil
}

// R19.2: a join or renewal whose replica stalls past attempt_timeout, is
// taken out while the call is in flight, or resets it, is resent to the
// next healthy replica and the first answer that settles it wins (a
// stalled replica's late answer is dropped). A join's refusal is final at
// once; a renewal's refusal is held while an earlier copy may have landed,
// and is UNAVAILABLE if nothing better comes. The replicas are tried in
// order (the first one first).
func TestHedgeR19_2(t *testing.T) { forServers(t, testHedgeR19_2) }

func testHedgeR19_2(t *testing.T, kind string) {
	const attemptTimeout = 5 * time.Second
	for _, c := range []struct {
		name  string
		modes []string // per replica in order; "down" is a listener that drops every connection
		renew bool
		// then is what happens once the first replica holds the call:
		// "deadline" moves the clock past attempt_timeout, "out" takes the
		// first replica out, "deadline+release" also releases the stalled
		// replica once the second answered.
		then     string
		want     string // the answer's body, or
		wantCode errs.Code
		wantMsg  string
	}{
		{name: "join, stalled replica misses the deadline", modes: []string{"stall", "ok"}, then: "deadline", want: "r1"},
		{name: "join, stalled replica taken out", modes: []string{"stall", "ok"}, then: "out", want: "r1"},
		{name: "join, stream reset", modes: []string{"reset", "ok"}, want: "r1"},
		{name: "join, connection dropped", modes: []string{"down", "ok"}, want: "r1"},
		{name: "join, two stalled then a healthy one", modes: []string{"stall", "stall", "ok"}, then: "deadline", want: "r2"},
		{name: "join, the resend's refusal is final", modes: []string{"stall", "refuse"}, then: "deadline",
			wantCode: errs.AccessDenied, wantMsg: "Refused by r1"},
		{name: "join, a refusal first is final", modes: []string{"refuse", "ok"}, wantCode: errs.AccessDenied, wantMsg: "Refused by r0"},
		{name: "renewal, stalled replica misses the deadline", modes: []string{"stall", "ok"}, renew: true, then: "deadline", want: "r1"},
		{name: "renewal, stream reset", modes: []string{"reset", "ok"}, renew: true, want: "r1"},
		{name: "renewal, the resend's refusal waits for the stalled copy", modes: []string{"stall", "refuse"}, renew: true,
			then: "deadline+release", want: "late-r0"},
		{name: "renewal, refused after a copy that may have landed", modes: []string{"reset", "refuse"}, renew: true,
			wantCode: errs.Unavailable, wantMsg: "the control plane is unavailable; retry later"},
		{name: "renewal, a refusal first is final", modes: []string{"refuse", "ok"}, renew: true, wantCode: errs.AccessDenied, wantMsg: "Refused by r0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			e.kind = kind
			var reps []*hedgeReplica
			var urls []string
			for i, m := range c.modes {
				if m == "down" {
					urls = append(urls, "https://"+droppingListener(t))
					reps = append(reps, nil)
					continue
				}
				r := startHedgeReplica(t, e, fmt.Sprintf("r%d", i), m)
				reps, urls = append(reps, r), append(urls, r.srv.URL)
			}
			clk := clock.NewFake(testNow)
			cfg := e.config("")
			cfg.APIURLs, cfg.AttemptTimeout = urls, attemptTimeout
			g, addr := startGatewayWith(t, cfg, Options{Log: quietLog(), Clock: clk})
			g.nextUp.Store(uint64(len(urls) - 1)) // the next pick is the first replica
			d := newDaemon(t, e, addr)

			type result struct {
				body []byte
				err  error
			}
			done := make(chan result, 1)
			go func() {
				ctx := context.Background()
				if c.renew {
					res, err := d.client.Renew(ctx, connect.NewRequest(&agentv1.RenewRequest{NodeId: "node_1", Csr: []byte("csr")}))
					if err != nil {
						done <- result{err: err}
						return
					}
					done <- result{body: res.Msg.GetBody()}
					return
				}
				res, err := d.client.Join(ctx, connect.NewRequest(&agentv1.JoinRequest{SealedToken: "t", Csr: []byte("csr")}))
				if err != nil {
					done <- result{err: err}
					return
				}
				done <- result{body: res.Msg.GetBody()}
			}()
			for i, m := range c.modes {
				if m != "stall" {
					break
				}
				<-reps[i].entered
				switch c.then {
				case "deadline", "deadline+release":
					poll.Until(t, 10*time.Second, "the attempt timer", func() bool { return clk.Armed() > 0 })
					clk.Advance(attemptTimeout)
				case "out":
					g.markDown(g.ups[i], errors.New("health check failed"))
				}
			}
			if c.then == "deadline+release" {
				poll.Until(t, 10*time.Second, "the second replica's refusal", func() bool { return reps[1].finished.Load() == 1 })
				reps[0].release <- struct{}{}
			}
			var r result
			select {
			case r = <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("no answer")
			}
			if c.wantCode != "" {
				if pe := productError(t, r.err); pe.Code != c.wantCode || pe.Message != c.wantMsg {
					t.Fatalf("got %s %q, want %s %q", pe.Code, pe.Message, c.wantCode, c.wantMsg)
				}
				return
			}
			if r.err != nil || string(r.body) != c.want {
				t.Fatalf("got %q, %v; want the answer of %s", r.body, r.err, c.want)
			}
			// Each replica saw the call at most once: the same bytes, resent
			// only to the next one.
			for _, rep := range reps {
				if rep != nil && rep.calls.Load() > 1 {
					t.Errorf("%s saw the call %d times", rep.name, rep.calls.Load())
				}
			}
		})
	}
}
