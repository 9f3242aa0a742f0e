package gateway

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
)

// Several API replicas behind one gateway. The gateway holds
// one upstream per api_urls entry, each with its own connections, and:
//   - spreads joins, renewals and new sessions over the healthy ones in
//     turn;
//   - checks each one's /readyz every healthEvery, and takes a replica out
//     at its first failed check or failed call, so a dead replica gets no
//     new call within a second; it comes back at its first good check;
//   - retries a join or renewal on another replica only where that is
//     idempotent by design: any call that never reached a replica (the
//     connection was refused), and a join whatever happened to it, because
//     a join request that arrives again gets the answer stored for it and
//     spends nothing (R4.9). A renewal that may have reached a replica is
//     not retried: it may have superseded the certificate it presents, and
//     renewal never accepts a superseded one, so bcd retries it itself
//     after reading the outcome.

const (
	// healthEvery is how often each replica is checked.
	healthEvery = 250 * time.Millisecond
	// healthTimeout bounds one check: a replica that does not answer
	// within it is out (healthEvery + healthTimeout < 1 s).
	healthTimeout = 700 * time.Millisecond
)

// upstream is one API replica's agent listener.
type upstream struct {
	base string
	// tr carries joins, renewals and health checks.
	tr   *http.Transport
	http *http.Client
	join agentv1connect.JoinServiceClient
	// raw relays the binary join and renewal calls as bytes, by procedure.
	raw map[string]*connect.Client[rawMsg, rawMsg]
	// sessions relay node sessions over UpstreamConns transports.
	sessions []agentv1connect.SessionServiceClient
	sessTrs  []*http.Transport
	next     atomic.Uint64
	down     atomic.Bool
}

func (u *upstream) closeIdle() {
	u.tr.CloseIdleConnections()
	for _, tr := range u.sessTrs {
		tr.CloseIdleConnections()
	}
}

// session returns the next of the replica's session clients.
func (u *upstream) session() agentv1connect.SessionServiceClient {
	return u.sessions[int(u.next.Add(1)%uint64(len(u.sessions)))]
}

// newUpstream builds the clients of one replica; newTransport makes each
// connection's transport.
func (g *Gateway) newUpstream(apiURL string, newTransport func() *http.Transport) *upstream {
	base := strings.TrimSuffix(apiURL, "/")
	u := &upstream{base: base, tr: newTransport(), raw: map[string]*connect.Client[rawMsg, rawMsg]{}}
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	u.http = &http.Client{Transport: u.tr, CheckRedirect: noRedirect}
	u.join = agentv1connect.NewJoinServiceClient(u.http, base, g.upstreamOptions()...)
	for _, proc := range []string{agentv1connect.JoinServiceJoinProcedure, agentv1connect.JoinServiceRenewProcedure} {
		u.raw[proc] = connect.NewClient[rawMsg, rawMsg](u.http, base+proc, g.upstreamOptions(connect.WithCodec(rawCodec{}))...)
	}
	for range g.cfg.UpstreamConns {
		tr := newTransport()
		u.sessTrs = append(u.sessTrs, tr)
		u.sessions = append(u.sessions, agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr, CheckRedirect: noRedirect}, base, g.upstreamOptions()...))
	}
	return u
}

// pick returns the next healthy replica not in tried; when every untried
// one is out, the next untried one anyway (a check may be stale, and an
// answer beats a certain UNAVAILABLE); nil when all were tried.
func (g *Gateway) pick(tried []*upstream) *upstream {
	n := len(g.ups)
	start := int(g.nextUp.Add(1) % uint64(n))
	var fallback *upstream
	for i := range n {
		u := g.ups[(start+i)%n]
		if slices.Contains(tried, u) {
			continue
		}
		if !u.down.Load() {
			return u
		}
		if fallback == nil {
			fallback = u
		}
	}
	return fallback
}

// markDown takes a replica out after a failed call; the next good check
// brings it back.
func (g *Gateway) markDown(u *upstream, err error) {
	if len(g.ups) == 1 {
		return // the only one: nowhere else to send, and no checks bring it back
	}
	if !u.down.Swap(true) {
		g.log.Warn("API replica out", "api_url", u.base, "err", err)
	}
}

// checkHealth checks every replica every healthEvery until the gateway
// stops.
func (g *Gateway) checkHealth() {
	t := g.clock.NewTicker(healthEvery)
	defer t.Stop()
	for {
		for _, u := range g.ups {
			go g.check(u)
		}
		select {
		case <-g.stopped.Done():
			return
		case <-t.C():
		}
	}
}

// check asks one replica's /readyz (which pings its database) over its
// join connection.
func (g *Gateway) check(u *upstream) {
	ctx, cancel := context.WithTimeout(g.stopped, healthTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.base+"/readyz", nil)
	if err != nil {
		return
	}
	res, err := u.http.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(res.Body, 1<<10))
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			err = errors.New(res.Status)
		}
	}
	if g.stopped.Err() != nil {
		return
	}
	if err != nil {
		g.markDown(u, err)
		return
	}
	if u.down.Swap(false) {
		g.log.Info("API replica back", "api_url", u.base)
	}
}

// notSent reports whether a failed call surely never reached the replica:
// its connection could not be made.
func notSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// retryable reports whether a call that failed with err (not an answer of
// the API) may go to another replica.
func retryable(procedure string, err error) bool {
	return notSent(err) || procedure == agentv1connect.JoinServiceJoinProcedure
}
