package gateway_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// resumeEnv is a gateway in front of the real API, both on one fake clock.
type resumeEnv struct {
	e      *apitest.Env
	clk    *clock.Fake
	gwAddr string
	roots  *x509.CertPool
}

func startResumeEnv(t *testing.T, e *apitest.Env, clk *clock.Fake, kind, relay string) *resumeEnv {
	t.Helper()
	r := startReplica(t, e.Server, e.Bundle)
	write := fileWriter(t)
	// The gateway's own certificate is checked by the test's daemons at
	// the wall clock, the gateway's clock moves: give it room.
	gwPEM, gwKey, err := ca.IssueGateway(e.Bundle, []string{"127.0.0.1"}, time.Now(), 30*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: write("gw.crt", gwPEM), KeyFile: write("gw.key", gwKey),
		APIURL: r.srv.URL, APICAFile: write("ca.pem", pki.CertPEM(e.Bundle.ServingCA)), DaemonHTTP2: kind, SessionRelay: relay},
		gateway.Options{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(e.Bundle.ServingCA)
	return &resumeEnv{e: e, clk: clk, gwAddr: apitest.ServeGateway(t, g), roots: roots}
}

// fileWriter returns a function that writes a file of the test's own
// directory (mode 0600) and returns its path.
func fileWriter(t *testing.T) func(name string, b []byte) string {
	t.Helper()
	dir := t.TempDir()
	return func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
}

// client is one TLS connection to the gateway, made with cert as client
// certificate (none when nil) and cache (nil: never resumed).
type client struct {
	join    agentv1connect.JoinServiceClient
	resumed bool
}

func (r *resumeEnv) dial(t *testing.T, cert *tls.Certificate, cache tls.ClientSessionCache) *client {
	t.Helper()
	c := &client{}
	tc := &tls.Config{RootCAs: r.roots, ServerName: "127.0.0.1", NextProtos: []string{"h2"}, ClientSessionCache: cache, MinVersion: tls.VersionTLS13}
	if cert != nil {
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
	}
	tr := &http.Transport{ForceAttemptHTTP2: true, DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		raw, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		conn := tls.Client(raw, tc)
		if err := conn.HandshakeContext(ctx); err != nil {
			raw.Close()
			return nil, err
		}
		c.resumed = conn.ConnectionState().DidResume
		return conn, nil
	}}
	t.Cleanup(tr.CloseIdleConnections)
	c.join = agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, "https://"+r.gwAddr, connect.WithGRPC())
	return c
}

// identity is a node's current certificate and key, as bcd holds them.
type identity struct {
	nodeID string
	m      *jointest.Machine
	chain  [][]byte
	leaf   *x509.Certificate
}

func (id *identity) cert() *tls.Certificate {
	return &tls.Certificate{Certificate: id.chain, PrivateKey: id.m.Key, Leaf: id.leaf}
}

// renew renews id over c; on success it returns the next identity.
func (r *resumeEnv) renew(t *testing.T, c *client, id *identity) (*identity, error) {
	t.Helper()
	req, next := jointest.RenewRequest(t, id.m.Key, id.chain, id.nodeID, r.clk.Now())
	res, err := c.join.Renew(context.Background(), connect.NewRequest(req))
	if err != nil {
		return nil, wire.FromWire(err) // as bcd reads it
	}
	j := next.VerifyRenewal(t, r.e.Bundle, res.Msg, "")
	return &identity{nodeID: id.nodeID, m: next, chain: j.Body.GetCertChain(), leaf: j.Leaf}, nil
}

// keys makes one Keys call over c and reports whether c resumed.
func (r *resumeEnv) keys(t *testing.T, c *client) bool {
	t.Helper()
	if _, err := c.join.Keys(context.Background(), connect.NewRequest(&agentv1.KeysRequest{})); err != nil {
		t.Fatalf("keys: %v", err)
	}
	return c.resumed
}

// joinOne joins a machine through the gateway (no client certificate).
func (r *resumeEnv) joinOne(t *testing.T, token string, i int) *identity {
	t.Helper()
	m := jointest.NewMachine(t, jointest.Claims(i))
	res, err := r.dial(t, nil, nil).join.Join(context.Background(), connect.NewRequest(m.Request(t, r.e.Bundle, token, "")))
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	j := m.Verify(t, r.e.Bundle, res.Msg, "")
	return &identity{nodeID: j.Body.GetNodeId(), m: m, chain: j.Body.GetCertChain(), leaf: j.Leaf}
}

// createToken makes a site, a bcd pool and a join token of maxUses in the
// root tenant, and returns the token and its pool's id.
func createToken(t *testing.T, e *apitest.Env, maxUses int32) (tok *bcv1.JoinToken, poolID string) {
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
	res, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, MaxUses: maxUses, TtlSeconds: 3600}))
	if err != nil {
		t.Fatal(err)
	}
	return res.Msg, pool.Msg.Id
}

// lastRefusal is the reason of the newest security.renew.refused event.
func lastRefusal(t *testing.T, e *apitest.Env) string {
	t.Helper()
	rs := jointest.RenewRefusals(t, e.DB, e.RootTenant)
	if len(rs) == 0 {
		t.Fatal("no renewal refusal recorded")
	}
	return rs[len(rs)-1].Reason
}

// R13.2, R12.1: a daemon that reconnects resumes its TLS session with the
// gateway's ticket, and the resumed connection is bound to the client
// certificate of the handshake that issued the ticket: the gateway
// forwards that certificate to the API as it forwards a presented one, so
// a revoked one is refused exactly as over a full handshake. A ticket
// whose certificate has expired is not resumed at all (crypto/tls falls
// back to a full handshake), and the refusal is again the full
// handshake's. Tickets older than 7 days by the gateway's clock are not
// resumed.
func TestTLSResumptionR13_2(t *testing.T) {
	for _, side := range []struct{ name, kind, relay string }{
		{"nethttp", gateway.DaemonHTTP2NetHTTP, gateway.SessionRelayGoroutines},
		{"framer", gateway.DaemonHTTP2Framer, gateway.SessionRelayGoroutines},
		{"framer-callbacks", gateway.DaemonHTTP2Framer, gateway.SessionRelayCallbacks},
	} {
		t.Run(side.name, func(t *testing.T) { testTLSResumption(t, side.kind, side.relay) })
	}
}

func testTLSResumption(t *testing.T, kind, relay string) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		clk := clock.NewFake(time.Now())
		e := apitest.Start(t, db, apitest.Options{Clock: clk})
		r := startResumeEnv(t, e, clk, kind, relay)
		tok, _ := createToken(t, e, 10)
		id1 := r.joinOne(t, tok.Token, 1)

		// The first connection with the node's certificate is a full
		// handshake and leaves a ticket bound to that certificate.
		cache := tls.NewLRUClientSessionCache(4)
		c := r.dial(t, id1.cert(), cache)
		id2, err := r.renew(t, c, id1)
		if err != nil || c.resumed {
			t.Fatalf("renewal over a full handshake: resumed %v, err %v", c.resumed, err)
		}
		// The next connection resumes, and the API sees the ticket's
		// certificate (id1's: superseded by now but within the session
		// overlap, so a valid identity of the node). Without it the
		// renewal would be refused (peer-missing).
		c = r.dial(t, id2.cert(), cache)
		id3, err := r.renew(t, c, id2)
		if err != nil || !c.resumed {
			t.Fatalf("renewal over a resumed connection: resumed %v, err %v", c.resumed, err)
		}

		// Revoked: the resumed connection is refused as the full handshake
		// with the same certificate is, for the same reason.
		if err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(context.Background(), pki.SerialHex(id1.leaf), "test")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		c = r.dial(t, id3.cert(), cache)
		_, err = r.renew(t, c, id3)
		if !c.resumed {
			t.Fatal("the connection after a revocation did not resume: the check below would not be of a resumed one")
		}
		jointest.WantRenewRefused(t, err)
		resumedReason := lastRefusal(t, e)
		_, err = r.renew(t, r.dial(t, id1.cert(), nil), id3)
		jointest.WantRenewRefused(t, err)
		if full := lastRefusal(t, e); resumedReason != "peer-revoked" || full != resumedReason {
			t.Errorf("refusal reasons: resumed %q, full handshake %q; want peer-revoked both", resumedReason, full)
		}

		// Expired: a ticket bound to id3, then the clock passes its
		// NotAfter. crypto/tls does not resume the ticket; the full
		// handshake it falls back to is refused as any other.
		cache3 := tls.NewLRUClientSessionCache(4)
		_ = r.keys(t, r.dial(t, id3.cert(), cache3))
		if c := r.dial(t, id3.cert(), cache3); !r.keys(t, c) {
			t.Fatal("a fresh ticket bound to a valid certificate did not resume")
		}
		clk.Set(id3.leaf.NotAfter.Add(time.Second))
		c = r.dial(t, id3.cert(), cache3)
		_, err = r.renew(t, c, id3)
		if c.resumed {
			t.Error("a ticket whose client certificate expired was resumed")
		}
		jointest.WantRenewRefused(t, err)
		resumedReason = lastRefusal(t, e)
		_, err = r.renew(t, r.dial(t, id3.cert(), nil), id3)
		jointest.WantRenewRefused(t, err)
		if full := lastRefusal(t, e); resumedReason != "cert-expired" || full != resumedReason {
			t.Errorf("refusal reasons: with a ticket %q, full handshake %q; want cert-expired both", resumedReason, full)
		}

		// Tickets live 7 days by the gateway's clock, whatever the client
		// keeps.
		anon := tls.NewLRUClientSessionCache(4)
		_ = r.keys(t, r.dial(t, nil, anon))
		if c := r.dial(t, nil, anon); !r.keys(t, c) {
			t.Fatal("a connection without a client certificate did not resume")
		}
		clk.Advance(7*24*time.Hour + time.Minute)
		if c := r.dial(t, nil, anon); r.keys(t, c) {
			t.Error("a ticket older than 7 days was resumed")
		}
	})
}

// R12.1: a node's session through the gateway, on each relay, reaches the
// real API: its Challenge comes first, the node's proof over it is
// accepted and Welcome names the node.
func TestSessionThroughTheGatewayR12_1(t *testing.T) {
	for _, side := range []struct{ name, kind, relay string }{
		{"nethttp", gateway.DaemonHTTP2NetHTTP, gateway.SessionRelayGoroutines},
		{"framer", gateway.DaemonHTTP2Framer, gateway.SessionRelayGoroutines},
		{"framer-callbacks", gateway.DaemonHTTP2Framer, gateway.SessionRelayCallbacks},
	} {
		t.Run(side.name, func(t *testing.T) {
			storetest.Each(t, func(t *testing.T, db *store.DB) {
				clk := clock.NewFake(time.Now())
				e := apitest.Start(t, db, apitest.Options{Clock: clk})
				r := startResumeEnv(t, e, clk, side.kind, side.relay)
				tok, _ := createToken(t, e, 1)
				id := r.joinOne(t, tok.Token, 1)
				tc := &tls.Config{RootCAs: r.roots, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS13,
					GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return id.cert(), nil }}
				tr := &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: tc}
				defer tr.CloseIdleConnections()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				s := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, "https://"+r.gwAddr, connect.WithGRPC()).Connect(ctx)
				defer func() { _ = s.CloseResponse() }()
				if err := s.Send(nil); err != nil {
					t.Fatal(err)
				}
				m, err := s.Receive()
				nonce := m.GetChallenge().GetNonce()
				if err != nil || len(nonce) == 0 {
					t.Fatalf("first answer %v (%v), want the API's Challenge", m, err)
				}
				proof, err := pki.SignSessionProof(id.m.Key, nonce, id.nodeID, id.leaf.Raw, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{
					Protocol: version.ProtocolMax, Proof: proof}}}); err != nil {
					t.Fatal(err)
				}
				m, err = s.Receive()
				if err != nil || m.GetWelcome().GetNodeId() != id.nodeID {
					t.Fatalf("after Hello: %v (%v), want Welcome for %s", m, err, id.nodeID)
				}
				_ = s.CloseRequest()
			})
		})
	}
}
