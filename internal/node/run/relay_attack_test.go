package run_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Attacks by a compromised gateway (docs/security.md): it holds
// the gateway's client credentials to the API's agent listener and sees
// every byte a machine sends through it. It may change or replay what it
// relays; it must gain nothing.

// relay is the compromised gateway's JoinService client: the gateway's own
// credentials, straight to the agent listener.
func (h *harness) relay(t *testing.T) agentv1connect.JoinServiceClient {
	t.Helper()
	return h.joinClient(t, h.agentURL, &h.gwCert)
}

// joinClient is a JoinService client of url that trusts the serving CA and
// presents cert (none when nil): the relay's to the agent listener, or a
// machine's to the gateway.
func (h *harness) joinClient(t *testing.T, url string, cert *tls.Certificate) agentv1connect.JoinServiceClient {
	t.Helper()
	roots := x509.NewCertPool()
	roots.AddCert(h.e.Bundle.ServingCA)
	tc := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots}
	if cert != nil {
		tc.Certificates = []tls.Certificate{*cert}
	}
	tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, url, connect.WithGRPC())
}

// captured is a machine's genuine join request, sealed by the machine, as
// the gateway sees it pass.
func captured(t *testing.T, h *harness, token string, i int) *agentv1.JoinRequest {
	t.Helper()
	req, _, _ := h.request(t, token, i)
	return req
}

// relayJoin sends req through the relay and returns the answer's body.
func relayJoin(t *testing.T, relay agentv1connect.JoinServiceClient, req *agentv1.JoinRequest) (*agentv1.JoinResponse, *agentv1.JoinResponseBody) {
	t.Helper()
	res, err := relay.Join(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	var body agentv1.JoinResponseBody
	if err := proto.Unmarshal(res.Msg.Body, &body); err != nil {
		t.Fatal(err)
	}
	return res.Msg, &body
}

func (h *harness) usesLeft(t *testing.T, token string) int {
	t.Helper()
	id, _, _ := strings.Cut(strings.TrimPrefix(token, "bcjt_"), ".")
	var j store.JoinToken
	if err := h.e.DB.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
		j, err = tx.GetJoinToken(context.Background(), id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return j.UsesLeft
}

func (h *harness) refusalReasons(t *testing.T, typ string) []string {
	t.Helper()
	var out []string
	for _, ev := range h.events(t, typ) {
		var d map[string]any
		_ = json.Unmarshal(ev.Data, &d)
		r, _ := d["reason"].(string)
		out = append(out, r)
	}
	return out
}

// R4.2: the relay rewrites a machine's join: its claims (to take over
// another machine's node), its role, its node id. Each is refused with the
// uniform answer and recorded as seal-request-mismatch; nothing is spent,
// and the machine's own request still joins.
func TestRelayRewrittenJoinRefusedR4_2(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		pool := h.pool(t, "p", nil)
		tok := h.token(t, pool, true)
		victim := h.join(t, h.token(t, pool, false), 41, 2)
		relay := h.relay(t)
		orig := captured(t, h, tok, 40)
		for _, tc := range []struct {
			name string
			mod  func(r *agentv1.JoinRequest)
		}{
			{"another machine's claims", func(r *agentv1.JoinRequest) { r.Claims = jointest.Claims(41) }},
			{"role site", func(r *agentv1.JoinRequest) { r.Role = "site" }},
			{"the victim's node id", func(r *agentv1.JoinRequest) { r.NodeId = victim.nodeID }},
			{"a hostname", func(r *agentv1.JoinRequest) { r.Claims.Hostname = "forged-by-gateway" }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				r := proto.Clone(orig).(*agentv1.JoinRequest)
				tc.mod(r)
				before := len(h.refusalReasons(t, "security.join.refused"))
				_, err := relay.Join(context.Background(), connect.NewRequest(r))
				pe, ok := errs.As(wire.FromWire(err))
				if !ok || pe.Code != errs.AccessDenied || pe.Message != "Join refused" {
					t.Fatalf("got %v, want ACCESS_DENIED Join refused", err)
				}
				got := h.refusalReasons(t, "security.join.refused")[before:]
				if len(got) != 1 || got[0] != "join-token:seal-request-mismatch" {
					t.Errorf("refusals %v, want join-token:seal-request-mismatch", got)
				}
			})
		}
		if u := h.usesLeft(t, tok); u != 5 {
			t.Errorf("usesLeft %d after rewritten joins, want 5", u)
		}
		if n := h.node(t, victim.nodeID); n.IdentityGeneration != 1 {
			t.Errorf("victim moved to generation %d", n.IdentityGeneration)
		}
		if _, err := relay.Join(context.Background(), connect.NewRequest(orig)); err != nil {
			t.Fatalf("the machine's own request: %v", err)
		}
	})
}

// R4.9: the relay replays a captured join (the token allows reclaims and
// has uses left: this used to move the node to its next generation and
// revoke its certificate). Each replay gets the stored answer — a
// certificate for a key the relay does not hold — and changes nothing.
func TestRelayReplayedJoinGainsNothingR4_9(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		pool := h.pool(t, "p", nil)
		tok := h.token(t, pool, true)
		relay := h.relay(t)
		req := captured(t, h, tok, 50)
		first, body := relayJoin(t, relay, req)
		for range 3 {
			res, err := relay.Join(context.Background(), connect.NewRequest(req))
			if err != nil {
				t.Fatalf("replay: %v", err)
			}
			if !proto.Equal(res.Msg, first) {
				t.Fatal("a replay got another answer")
			}
		}
		n := h.node(t, body.NodeId)
		if n.IdentityGeneration != 1 || n.State == store.NodeRetired {
			t.Errorf("node %+v after replays: want generation 1", n)
		}
		if u := h.usesLeft(t, tok); u != 4 {
			t.Errorf("usesLeft %d after replays, want 4", u)
		}
		if r := h.refusalReasons(t, "security.certificate-revoked"); len(r) != 0 {
			t.Errorf("certificates revoked by replays: %v", r)
		}
	})
}

// R6.3: a reclaim needs a key never issued to the node. The relay cannot
// re-use the machine's own key in a new request to move the node to a new
// generation either.
func TestRelayReclaimWithIssuedKeyRefusedR6_3(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		pool := h.pool(t, "p", nil)
		tok := h.token(t, pool, true)
		relay := h.relay(t)
		req := captured(t, h, tok, 60)
		_, body := relayJoin(t, relay, req)
		// The same CSR (key) in another request: the relay cannot reseal
		// the token (it never saw it), but a holder of the token can.
		again := proto.Clone(req).(*agentv1.JoinRequest)
		again.Claims.Hostname = "reinstalled"
		again.SealedToken = jointest.Seal(t, h.e.Bundle, tok, again)
		_, err := relay.Join(context.Background(), connect.NewRequest(again))
		if pe, ok := errs.As(wire.FromWire(err)); !ok || pe.Code != errs.AccessDenied {
			t.Fatalf("got %v, want ACCESS_DENIED", err)
		}
		if got := h.refusalReasons(t, "security.join.refused"); len(got) != 1 || got[0] != "join-token:reclaim-key-reused" {
			t.Errorf("refusals %v, want join-token:reclaim-key-reused", got)
		}
		if n := h.node(t, body.NodeId); n.IdentityGeneration != 1 {
			t.Errorf("node moved to generation %d", n.IdentityGeneration)
		}
	})
}

// R13.2: a renewal supersedes its parent. Someone holding the key of a
// superseded certificate (a backup taken before the renewal) renews
// nothing through the real gateway, even presenting that certificate for
// mTLS.
func TestRenewFromSupersededRefusedR13_2(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		e := h.e
		pool := h.pool(t, "p", nil)
		m := h.join(t, h.token(t, pool, false), 70, 2)
		chain := make([][]byte, len(m.id.Chain))
		for i, c := range m.id.Chain {
			chain[i] = c.Raw
		}
		// The node renews (bcd's renewal loop, in-process here).
		req, _ := jointest.RenewRequest(t, m.id.Signer, chain, m.nodeID, time.Now())
		if _, err := e.Server.Join().Renew(context.Background(), req, join.Peer{Cert: chain[0]}); err != nil {
			t.Fatalf("renew: %v", err)
		}
		// The backup's holder renews through the gateway with the old
		// certificate and key.
		c := h.joinClient(t, "https://"+h.gwAddr, m.tlsCert())
		again, _ := jointest.RenewRequest(t, m.id.Signer, chain, m.nodeID, time.Now())
		_, err := c.Renew(context.Background(), connect.NewRequest(again))
		pe, ok := errs.As(wire.FromWire(err))
		if !ok || pe.Code != errs.AccessDenied || pe.Message != "Renew refused" {
			t.Fatalf("got %v, want ACCESS_DENIED Renew refused", err)
		}
		if got := h.refusalReasons(t, "security.renew.refused"); len(got) != 1 || got[0] != "cert-superseded" {
			t.Errorf("refusals %v, want cert-superseded", got)
		}
	})
}

// R10.5: x509pop accepts only the node's newest certificate. The
// key of a certificate from before a renewal (a backup) re-joins nothing
// through the real gateway, and the live node keeps its generation and
// certificate.
func TestX509PopWithOlderKeyRefusedR10_5(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		c := clock.NewFake(time.Now())
		e := apitest.Start(t, db, apitest.Options{Clock: c, Attestors: []string{wire.AttestorJoinToken, wire.AttestorX509Pop}})
		h := newHarness(t, e, c, stackNetHTTP)
		pool := h.pool(t, "p", nil)
		m := h.join(t, h.token(t, pool, false), 80, 2)
		chain := make([][]byte, len(m.id.Chain))
		for i, cert := range m.id.Chain {
			chain[i] = cert.Raw
		}
		req, _ := jointest.RenewRequest(t, m.id.Signer, chain, m.nodeID, c.Now())
		if _, err := e.Server.Join().Renew(context.Background(), req, join.Peer{Cert: chain[0]}); err != nil {
			t.Fatalf("renew: %v", err)
		}
		// The backup's key, past its certificate's expiry, re-joining
		// through the gateway as bcd join --attestor x509pop would.
		c.Set(m.id.Leaf().NotAfter.Add(time.Hour))
		backup := &jointest.Machine{Key: jointest.Key(t), Claims: jointest.Claims(80)}
		backup.CSR = jointest.CSR(t, backup.Key)
		pop := backup.X509PopRequest(t, m.id.Signer, chain, m.nodeID, c.Now())
		client := h.joinClient(t, "https://"+h.gwAddr, nil)
		_, err := client.Join(context.Background(), connect.NewRequest(pop))
		pe, ok := errs.As(wire.FromWire(err))
		if !ok || pe.Code != errs.AccessDenied || pe.Message != "Join refused" {
			t.Fatalf("got %v, want ACCESS_DENIED Join refused", err)
		}
		if got := h.refusalReasons(t, "security.join.refused"); len(got) != 1 || got[0] != "x509pop:cert-superseded" {
			t.Errorf("refusals %v, want x509pop:cert-superseded", got)
		}
		if n := h.node(t, m.nodeID); n.IdentityGeneration != 1 {
			t.Errorf("the node moved to generation %d", n.IdentityGeneration)
		}
	})
}
