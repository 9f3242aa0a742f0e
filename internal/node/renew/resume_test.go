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

// R13.2: a renewal made while bcd's session holds a TLS ticket of the same
// identity resumes that TLS session (the gateway sees the same client
// certificate, carried by the ticket) and succeeds; the renewed identity
// starts without tickets, so the next renewal presents its new certificate
// in a full handshake.
func TestRenewResumesTheSessionsTLSR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		tickets := &enroll.TicketCache{}
		var full, resumed atomic.Int64
		counting := func(c *tls.Config) *http.Client {
			verify := c.VerifyConnection
			c.VerifyConnection = func(cs tls.ConnectionState) error {
				if cs.DidResume {
					resumed.Add(1)
				} else {
					full.Add(1)
				}
				return verify(cs)
			}
			return noProxy(c)
		}

		// What the session's connection leaves: a ticket bound to the
		// joined certificate.
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
		tc.ClientSessionCache = tickets.For(chain[0])
		session := agentv1connect.NewJoinServiceClient(counting(tc), s.cfg.GatewayURL, connect.WithGRPC())
		if _, err := session.Keys(context.Background(), connect.NewRequest(&agentv1.KeysRequest{})); err != nil {
			t.Fatal(err)
		}

		r := s.renewer(t, func(c *renew.Config) { c.Tickets, c.HTTPClient = tickets, counting })
		if _, err := r.RenewOnce(context.Background()); err != nil {
			t.Fatalf("renewal over the resumed TLS session: %v", err)
		}
		if full.Load() != 1 || resumed.Load() != 1 {
			t.Fatalf("%d full handshakes, %d resumed; want the session's full one, then the renewal resumed", full.Load(), resumed.Load())
		}
		if _, err := r.RenewOnce(context.Background()); err != nil {
			t.Fatalf("renewal with the renewed certificate: %v", err)
		}
		if full.Load() != 2 || resumed.Load() != 1 {
			t.Fatalf("%d full handshakes, %d resumed; want the renewed identity's first connection a full handshake", full.Load(), resumed.Load())
		}
	})
}
