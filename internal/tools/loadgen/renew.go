package loadgen

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// RenewResult is what the renewal phase of a renew-mode run measured.
type RenewResult struct {
	// Machines is how many joined machines renewed; each renewed
	// RenewalsPerMachine times, one after the other.
	Machines           int  `json:"machines"`
	RenewalsPerMachine int  `json:"renewalsPerMachine"`
	Concurrency        int  `json:"concurrency"`
	NewConnections     bool `json:"newConnections"`
	// Resume and Resumed: whether machines kept TLS session caches
	// (Config.Resume), and how many timed connections resumed.
	Resume  bool  `json:"resume"`
	Resumed int64 `json:"resumed"`
	// Renewed counts successful renewals (of Machines*RenewalsPerMachine).
	Renewed           int                `json:"renewed"`
	Refused           int                `json:"refused"`
	Failed            int                `json:"failed"`
	Skipped           int                `json:"skipped"`
	Errors            map[string]int     `json:"errors,omitempty"`
	Seconds           float64            `json:"seconds"`
	RenewalsPerSecond float64            `json:"renewalsPerSecond"`
	P50ms             float64            `json:"p50Ms"`
	P90ms             float64            `json:"p90Ms"`
	P99ms             float64            `json:"p99Ms"`
	MaxMs             float64            `json:"maxMs"`
	CPUmsPerRenewal   map[string]float64 `json:"cpuMsPerRenewal,omitempty"`
	Verified          int                `json:"verified"`
}

// renewal is one renewal of one node: the next key and CSR (made before
// the clock starts), and what happened.
type renewal struct {
	key     *ecdsa.PrivateKey
	csr     []byte
	res     *agentv1.RenewResponse
	latency time.Duration
	err     error
}

// node is a joined machine: its identity (as bcd would hold it) and its
// planned renewals.
type node struct {
	id, trustDomain, site, role string
	key                         *ecdsa.PrivateKey // the current key
	chain                       [][]byte          // the current chain, leaf first
	leaf                        *x509.Certificate
	renewals                    []*renewal
	// tickets is the TLS session cache of the current identity (nil:
	// none, Config.Resume off).
	tickets tls.ClientSessionCache
}

// clientCert is the node's current certificate, as bcd presents it.
func (n *node) clientCert() *tls.Certificate {
	return &tls.Certificate{Certificate: n.chain, PrivateKey: n.key, Leaf: n.leaf}
}

// runRenew renews every joined machine cfg.Renewals times through the
// gateway, as bcd's RenewOnce does, and verifies every answer afterwards
// with enroll.VerifyRenewResponse.
//
// Connections: a renewing machine authenticates with its own certificate,
// so connections are never shared across machines. With NewConnections
// every renewal dials anew (what a fleet of bcds does: one renewal per
// machine every 60% of the lifetime); otherwise a machine's renewals share
// that machine's one connection (only meaningful with Renewals > 1; its
// TLS client certificate stays the one it dialed with, which remains a
// valid certificate of the node).
func runRenew(ctx context.Context, cfg Config, tg *target, ms []*machine, progress func(string)) (*RenewResult, error) {
	var nodes []*node
	for _, m := range ms {
		if m.body == nil {
			continue
		}
		leaf, err := x509.ParseCertificate(m.body.GetCertChain()[0])
		if err != nil {
			return nil, err
		}
		nodes = append(nodes, &node{id: m.body.GetNodeId(), trustDomain: m.body.GetTrustDomain(), site: m.body.GetSiteId(), role: m.body.GetRole(),
			key: m.key, chain: m.body.GetCertChain(), leaf: leaf})
	}
	progress(fmt.Sprintf("preparing %d renewals of %d nodes (next keys, CSRs)…", len(nodes)*cfg.Renewals, len(nodes)))
	for _, n := range nodes {
		for range cfg.Renewals {
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			if err != nil {
				return nil, err
			}
			csr, err := identity.NewCSR(key, n.id)
			if err != nil {
				return nil, err
			}
			n.renewals = append(n.renewals, &renewal{key: key, csr: csr})
		}
	}
	// The expectations need the identity before each renewal; keep the
	// joined one to replay the chain of renewals when verifying.
	first := make([]node, len(nodes))
	for i, n := range nodes {
		first[i] = *n
	}

	var resumed atomic.Int64
	timing := atomic.Bool{}
	newClient := func(n *node) agentv1connect.JoinServiceClient {
		tc := tg.tlsConf.Clone()
		tc.ClientSessionCache = n.tickets
		verify := tc.VerifyConnection
		tc.VerifyConnection = func(cs tls.ConnectionState) error {
			if cs.DidResume && timing.Load() {
				resumed.Add(1)
			}
			return verify(cs)
		}
		// Asked once per handshake: the node's certificate at dial time.
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return n.clientCert(), nil }
		tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 1,
			DisableKeepAlives: cfg.NewConnections, TLSHandshakeTimeout: 30 * time.Second}
		return agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr, Timeout: 60 * time.Second}, tg.bc.GatewayURL, connect.WithGRPC())
	}

	mode := "a new TLS connection per renewal"
	if !cfg.NewConnections {
		mode = "each machine's renewals over its own connection"
	}
	if cfg.Resume {
		mode += ", resuming TLS sessions"
		progress("one call per node with its certificate, for a TLS session ticket…")
		if err := primeTickets(ctx, cfg, nodes, newClient); err != nil {
			return nil, err
		}
	}
	progress(fmt.Sprintf("renewing %d nodes %d time(s) each, %d at a time, %s…", len(nodes), cfg.Renewals, cfg.Concurrency, mode))
	timing.Store(true)
	before := cpuTimes(cfg.PIDs)
	start := time.Now()
	forEachNode(ctx, cfg.Concurrency, len(nodes), func(i int) bool {
		n := nodes[i]
		var client agentv1connect.JoinServiceClient
		for _, rn := range n.renewals {
			if client == nil || cfg.NewConnections {
				client = newClient(n)
			}
			if !renewOne(ctx, client, n, rn) {
				break
			}
			if n.tickets != nil {
				n.tickets = tls.NewLRUClientSessionCache(1) // a new identity
			}
		}
		return true
	})
	elapsed := time.Since(start)
	after := cpuTimes(cfg.PIDs)

	r := tallyRenewals(cfg, nodes, elapsed)
	r.CPUmsPerRenewal = cpuPer(before, after, r.Renewed)
	r.Resume, r.Resumed = cfg.Resume, resumed.Load()
	if cfg.Verify {
		progress("checking every renewal answer as bcd does…")
		if err := verifyRenewals(tg, first, nodes, r); err != nil {
			return r, err
		}
	}
	return r, nil
}

// primeTickets gives every node a TLS session ticket bound to its current
// certificate: one Keys call each over a connection of its own, cfg.Concurrency
// at a time, before the clock starts.
func primeTickets(ctx context.Context, cfg Config, nodes []*node, newClient func(*node) agentv1connect.JoinServiceClient) error {
	var failed atomic.Pointer[error]
	forEachNode(ctx, cfg.Concurrency, len(nodes), func(i int) bool {
		n := nodes[i]
		n.tickets = tls.NewLRUClientSessionCache(1)
		if _, err := newClient(n).Keys(ctx, connect.NewRequest(&agentv1.KeysRequest{})); err != nil {
			err = fmt.Errorf("keys call for a session ticket: %w", err)
			failed.Store(&err)
			return false
		}
		return true
	})
	if p := failed.Load(); p != nil {
		return *p
	}
	return ctx.Err()
}

// forEachNode calls fn(0) … fn(n-1) from concurrency goroutines, each
// taking the next index, until every one ran, fn returns false, or ctx
// ends.
func forEachNode(ctx context.Context, concurrency, n int, fn func(i int) bool) {
	var next atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() && ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if !fn(i) {
					stop.Store(true)
				}
			}
		}()
	}
	wg.Wait()
}

// tallyRenewals sums the timed phase's outcomes and latencies.
func tallyRenewals(cfg Config, nodes []*node, elapsed time.Duration) *RenewResult {
	r := &RenewResult{Machines: len(nodes), RenewalsPerMachine: cfg.Renewals, Concurrency: cfg.Concurrency, NewConnections: cfg.NewConnections,
		Seconds: elapsed.Seconds(), Errors: map[string]int{}}
	var lat []time.Duration
	for _, n := range nodes {
		for _, rn := range n.renewals {
			switch {
			case rn.err == nil && rn.res != nil:
				r.Renewed++
				lat = append(lat, rn.latency)
			case rn.err == nil:
				r.Skipped++ // after an earlier failure of the same node
			case errs.Is(rn.err, errs.AccessDenied):
				r.Refused++
			default:
				r.Failed++
				r.Errors[rn.err.Error()]++
			}
		}
	}
	r.RenewalsPerSecond = float64(r.Renewed) / elapsed.Seconds()
	st := statsOf(lat)
	r.P50ms, r.P90ms, r.P99ms, r.MaxMs = st.p50, st.p90, st.p99, st.max
	return r
}

// verifyRenewals checks every renewal answer as bcd does, replaying each
// node's chain of renewals from its joined identity (first).
func verifyRenewals(tg *target, first []node, nodes []*node, r *RenewResult) error {
	for i := range first {
		cur := first[i]
		for k, rn := range nodes[i].renewals {
			if rn.res == nil {
				break
			}
			body, err := enroll.VerifyRenewResponse(rn.res, enroll.RenewExpectation{
				SigningPins: tg.bc.JoinSigningPins(), CSRHash: pki.CSRHash(rn.csr), NodeKey: rn.key.Public(),
				TrustDomain: cur.trustDomain, SiteID: cur.site, NodeID: cur.id, Role: cur.role,
			})
			if err != nil {
				return fmt.Errorf("renewal %d of node %s: %w", k+1, cur.id, err)
			}
			cur.trustDomain, cur.site, cur.role = body.GetTrustDomain(), body.GetSiteId(), body.GetRole()
			r.Verified++
		}
	}
	return nil
}

// renewOne sends one renewal as bcd's RenewOnce does and, on success,
// moves n to the new identity (unverified here: the answers are checked
// after the timed phase). It reports whether n may renew again.
func renewOne(ctx context.Context, client agentv1connect.JoinServiceClient, n *node, rn *renewal) bool {
	now := time.Now().UnixMilli()
	pop, err := pki.SignRenewPoP(n.key, rn.csr, n.id, now)
	if err != nil {
		rn.err = err
		return false
	}
	req := &agentv1.RenewRequest{Csr: rn.csr, Chain: n.chain, ClientTimeUnixMs: now, PopSig: pop, NodeId: n.id}
	t0 := time.Now()
	res, err := client.Renew(ctx, connect.NewRequest(req))
	rn.latency = time.Since(t0)
	if err != nil {
		rn.err = wire.FromWire(err)
		return false
	}
	rn.res = res.Msg
	// The next renewal needs the new certificate: read it from the
	// answer's body now, check the signature later.
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.Msg.GetBody(), &body); err != nil || len(body.GetCertChain()) == 0 {
		rn.err = errs.Wrap(err, errs.Internal, "renewal answer without a certificate: %v", err)
		return false
	}
	leaf, err := x509.ParseCertificate(body.GetCertChain()[0])
	if err != nil {
		rn.err = err
		return false
	}
	n.key, n.chain, n.leaf = rn.key, body.GetCertChain(), leaf
	return true
}
