package renew_test

import (
	"context"
	"crypto/tls"
	"net/http"
	"net/url"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/renew"
)

// R13.2: while bcd run's session is welcomed on the current certificate,
// a renewal is one more call on the session's connection: no TLS
// handshake and no connection of its own, and the control plane admits
// it on the certificate that connection presented. The next renewal,
// from the renewed certificate the session is not on, dials its own.
func TestRenewOverTheSessionsConnectionR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		var handshakes, dials atomic.Int64
		u, err := url.Parse(s.cfg.GatewayURL)
		if err != nil {
			t.Fatal(err)
		}
		tc, err := enroll.PinnedTLSConfig(s.cfg.ServingCAPins(), u.Hostname(), nil)
		if err != nil {
			t.Fatal(err)
		}
		id := s.joined
		chain := make([][]byte, len(id.Chain))
		for i, c := range id.Chain {
			chain[i] = c.Raw
		}
		tc.Certificates = []tls.Certificate{{Certificate: chain, PrivateKey: id.Signer, Leaf: id.Leaf()}}
		verify := tc.VerifyConnection
		tc.VerifyConnection = func(cs tls.ConnectionState) error { handshakes.Add(1); return verify(cs) }
		// The session's client, its connection open.
		session := noProxy(tc)
		defer session.CloseIdleConnections()
		if _, err := agentv1connect.NewJoinServiceClient(session, s.cfg.GatewayURL, connect.WithGRPC()).
			Keys(context.Background(), connect.NewRequest(&agentv1.KeysRequest{})); err != nil {
			t.Fatal(err)
		}

		conn := &renew.SessionConn{}
		withdraw := conn.Offer(id.Serial, session)
		r := s.renewer(t, func(c *renew.Config) {
			c.Session = conn
			c.HTTPClient = func(c *tls.Config) *http.Client { dials.Add(1); return noProxy(c) }
		})
		renewed, err := r.RenewOnce(context.Background())
		if err != nil {
			t.Fatalf("renewal over the session's connection: %v", err)
		}
		if handshakes.Load() != 1 || dials.Load() != 0 {
			t.Fatalf("%d handshakes, %d clients of the renewer's own; want the session's one connection only", handshakes.Load(), dials.Load())
		}
		if renewed.Serial == id.Serial {
			t.Fatal("not renewed")
		}
		if _, err := r.RenewOnce(context.Background()); err != nil {
			t.Fatalf("renewal of the renewed certificate: %v", err)
		}
		if handshakes.Load() != 1 || dials.Load() != 1 {
			t.Fatalf("%d session handshakes, %d clients of the renewer's own; want the renewed certificate on a connection of its own", handshakes.Load(), dials.Load())
		}
		withdraw()
		if conn.For(id.Serial) != nil {
			t.Error("a withdrawn session connection is still offered")
		}
	})
}

// A session's withdrawal takes back its own offer only, never the next
// session's; a nil SessionConn offers nothing.
func TestSessionConnOffers(t *testing.T) {
	conn := &renew.SessionConn{}
	a, b := &http.Client{}, &http.Client{}
	withdrawA := conn.Offer("0a", a)
	if conn.For("0a") != a || conn.For("0b") != nil || conn.For("") != nil {
		t.Fatal("the offer of 0a")
	}
	withdrawB := conn.Offer("0b", b)
	withdrawA()
	if conn.For("0b") != b || conn.For("0a") != nil {
		t.Fatal("0a's withdrawal took back 0b's offer")
	}
	withdrawB()
	if conn.For("0b") != nil {
		t.Fatal("0b still offered")
	}
	var none *renew.SessionConn
	none.Offer("0a", a)()
	if none.For("0a") != nil {
		t.Fatal("a nil SessionConn offered a client")
	}
}
