package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/gateway/h2upstream"
	"github.com/better-compute/better-compute/internal/shared/certfile"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// Several API replicas behind one gateway. The gateway holds
// one upstream per api_urls entry, each with its own connections, and:
//   - spreads joins, renewals and new sessions over the healthy ones in
//     turn;
//   - checks each one's /readyz every healthEvery, and takes a replica out
//     at its first failed check or failed call, so a dead replica gets no
//     new call within a second; it comes back at its first good check;
//   - resends a join or renewal, the same bytes, to another replica when
//     its replica fails it without an answer, is taken out while it is in
//     flight, or misses the per-attempt deadline (hedge.go, R19.2). The
//     first answer wins; the others are cancelled and dropped.

const (
	// healthEvery is how often each replica is checked.
	healthEvery = 250 * time.Millisecond
	// healthTimeout bounds one check: a replica that does not answer
	// within it is out (healthEvery + healthTimeout < 1 s).
	healthTimeout = 700 * time.Millisecond
)

// roundTripper is an upstream's transport: an *http.Transport to an agent
// listener, or localTransport in the API's process (inprocess.go).
type roundTripper interface {
	http.RoundTripper
	CloseIdleConnections()
}

// upstream is one API replica's agent listener.
type upstream struct {
	base string
	// tr carries joins, renewals and health checks.
	tr   roundTripper
	http *http.Client
	join agentv1connect.JoinServiceClient
	// raw relays the binary join and renewal calls as bytes, by procedure.
	raw map[string]*connect.Client[rawMsg, rawMsg]
	// h2 relays node sessions on callbacks (session_relay = "callbacks",
	// session_callbacks.go) over UpstreamConns connections; nil otherwise.
	h2          *h2upstream.Client
	sessionPath string
	// sessions relay node sessions over UpstreamConns transports.
	sessions []agentv1connect.SessionServiceClient
	sessTrs  []roundTripper
	next     atomic.Uint64
	down     atomic.Bool
	// mu guards outC, closed when the replica is taken out (a hedged call
	// in flight on it moves on at once) and replaced when it comes back.
	mu   sync.Mutex
	outC chan struct{}
	// relayErrors counts this replica's relay errors (pre-curried).
	relayErrors prometheus.Counter
}

// setDown marks the replica out or back and reports whether that changed.
func (u *upstream) setDown(down bool) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.down.Load() == down {
		return false
	}
	u.down.Store(down)
	if down {
		close(u.outC)
	} else {
		u.outC = make(chan struct{})
	}
	return true
}

// outSignal returns a channel closed when the replica is taken out, nil
// when it is out already (a fallback pick: nothing to wait for).
func (u *upstream) outSignal() <-chan struct{} {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.down.Load() {
		return nil
	}
	return u.outC
}

// upstreamDialer dials the API's agent listeners.
var upstreamDialer = &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}

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

// remoteUpstreams builds an upstream per api_urls entry: mTLS with the
// gateway's certificate (pair), the API verified against api_ca_file.
func (g *Gateway) remoteUpstreams(pair *certfile.Pair) error {
	roots, err := certfile.LoadPool(g.cfg.APICAFile, g.log)
	if err != nil {
		return badKey("api_ca_file", "%v", err)
	}

	// SECURITY: the API is authenticated against the serving CA only,
	// never the system roots, and sees the gateway's own certificate.
	tlsConfig := func() *tls.Config {
		return &tls.Config{
			MinVersion: tls.VersionTLS12,
			// Verified by VerifyConnection against the CA file in
			// force (it may gain the next serving CA).
			InsecureSkipVerify: true,
			VerifyConnection: func(cs tls.ConnectionState) error {
				return certfile.VerifyServer(cs, roots.Get())
			},
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return pair.Get(), nil },
		}
	}
	newTransport := func() roundTripper {
		return &http.Transport{
			Proxy:                 nil, // SECURITY: never route the gateway's identity through an environment proxy
			DialContext:           upstreamDialer.DialContext,
			ForceAttemptHTTP2:     true,
			TLSHandshakeTimeout:   10 * time.Second,
			MaxIdleConns:          256,
			MaxIdleConnsPerHost:   256,
			IdleConnTimeout:       90 * time.Second,
			ExpectContinueTimeout: time.Second,
			TLSClientConfig:       tlsConfig(),
			// Health pings find a dead API connection before a call waits on it.
			// The smallest frames HTTP/2 allows: the API answers with frames of
			// this size, and agent messages are small (max_body_bytes).
			// Windows are not allocations, but a stream's receive buffer can
			// grow to its window if a reader lags: 256 KiB bounds it.
			HTTP2: &http.HTTP2Config{
				SendPingTimeout:           30 * time.Second,
				PingTimeout:               15 * time.Second,
				MaxReadFrameSize:          16 << 10,
				MaxReceiveBufferPerStream: 256 << 10,
			},
		}
	}
	for _, a := range g.cfg.apiURLs() {
		u := g.newUpstream(a, newTransport)
		if g.cfg.SessionRelay == SessionRelayCallbacks {
			if err := g.newSessionClient(u, tlsConfig()); err != nil {
				return err
			}
		}
		g.ups = append(g.ups, u)
	}
	return nil
}

// newUpstream builds the clients of one replica; newTransport makes each
// connection's transport.
func (g *Gateway) newUpstream(apiURL string, newTransport func() roundTripper) *upstream {
	base := strings.TrimSuffix(apiURL, "/")
	u := &upstream{base: base, tr: newTransport(), raw: map[string]*connect.Client[rawMsg, rawMsg]{}, outC: make(chan struct{})}
	noRedirect := func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	u.http = &http.Client{Transport: tracing.Transport(g.tracer, u.tr), CheckRedirect: noRedirect}
	u.join = agentv1connect.NewJoinServiceClient(u.http, base, g.upstreamOptions()...)
	for _, proc := range []string{agentv1connect.JoinServiceJoinProcedure, agentv1connect.JoinServiceRenewProcedure} {
		u.raw[proc] = connect.NewClient[rawMsg, rawMsg](u.http, base+proc, g.upstreamOptions(connect.WithCodec(rawCodec{}))...)
	}
	for range g.cfg.UpstreamConns {
		tr := newTransport()
		u.sessTrs = append(u.sessTrs, tr)
		// A session's trace context goes on to the API like a call's.
		u.sessions = append(u.sessions, agentv1connect.NewSessionServiceClient(&http.Client{Transport: tracing.Transport(g.tracer, tr), CheckRedirect: noRedirect}, base, g.upstreamOptions()...))
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
	if u.setDown(true) {
		g.log.Warn("API replica out", "api_url", u.base, "err", err)
	}
}

// checkHealth checks every replica every healthEvery until the gateway
// stops; each check is a task of its own (Shutdown waits for them).
func (g *Gateway) checkHealth() {
	t := g.clock.NewTicker(healthEvery)
	defer t.Stop()
	for {
		for _, u := range g.ups {
			g.tasks.Go(func() { g.check(u) })
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
	err := probe(ctx, u)
	if g.stopped.Err() != nil {
		return
	}
	if err != nil {
		g.markDown(u, err)
		return
	}
	if u.setDown(false) {
		g.log.Info("API replica back", "api_url", u.base)
	}
}

// notSent reports whether a failed call surely never reached the replica:
// its connection could not be made, or the gateway was stopping.
func notSent(err error) bool {
	var op *net.OpError
	return errors.Is(err, errStopped) || errors.As(err, &op) && op.Op == "dial"
}
