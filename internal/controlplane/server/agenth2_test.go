package server

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// A gateway relays its sessions over a few connections to the agent
// listener. On h2server ([agent] http2 = "framer"), many of them ending
// at once (a site's daemons gone: the gateway resets their streams) must
// not end the connection, and with it the sessions it still carries.
func TestAgentFramerSessionsEndTogether(t *testing.T) {
	const held, leaving = 300, 250
	db := storetest.OpenSQLite(t)
	e := apitest.Start(t, db, apitest.Options{})
	certPEM, keyPEM, err := ca.IssueGateway(e.Bundle, []string{"127.0.0.1"}, time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	cfg := Config{Agent: AgentConfig{Listen: "127.0.0.1:0", HTTP2: AgentHTTP2Framer}}
	as, ln, err := listenAgent(cfg, Options{AgentCert: &cert}, log, e.Server, e.Bundle, ratelimit.NewLogger(log, ratelimit.New(clock.Real{}, 10, time.Minute)))
	if err != nil {
		t.Fatal(err)
	}
	f, err := newAgentFramer(as, e.Server, log)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); _ = f.h2.Serve(ln) }()
	t.Cleanup(func() { _ = f.h2.Close(); <-served })

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	// One transport: every session on one connection.
	client := agentv1connect.NewSessionServiceClient(&http.Client{Transport: apitest.GatewayTransport(t, e.Bundle)}, "https://"+ln.Addr().String(), connect.WithGRPC())
	type open struct {
		node   string
		s      *connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]
		cancel context.CancelFunc
	}
	var sessions []open
	for range held {
		n := storetest.Node(t, db, store.NodeAdopted)
		der := recordNodeCert(t, e.Bundle, db, n, key)
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		s := client.Connect(ctx)
		wire.SetPeerCertificate(s.RequestHeader(), der)
		if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		m, err := s.Receive()
		if err != nil {
			t.Fatal(err)
		}
		proof, err := pki.SignSessionProof(key, m.GetChallenge().GetNonce(), n.ID, der, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof}}}); err != nil {
			t.Fatal(err)
		}
		if m, err := s.Receive(); err != nil || m.GetWelcome() == nil {
			t.Fatalf("Hello answered %v, %v", m, err)
		}
		sessions = append(sessions, open{node: n.ID, s: s, cancel: cancel})
	}
	for _, o := range sessions[:leaving] {
		// As the gateway ends a session whose daemon left: the stream
		// is reset.
		o.cancel()
		_ = o.s.CloseRequest()
		_ = o.s.CloseResponse()
	}
	svc := e.Server.Sessions()
	poll.Until(t, 20*time.Second, "the sessions that left ended", func() bool { return svc.Held() <= held-leaving })
	// The others are still there, on the same connection: each is told
	// its node was retired.
	for _, o := range sessions[leaving:] {
		svc.EndNode(o.node, session.EndRetired)
		_, err := o.s.Receive()
		var pe *errs.E
		if !errors.As(wire.FromWire(err), &pe) || pe.Code != errs.InvalidState {
			t.Fatalf("a session that stayed ended with %v; want INVALID_STATE (its node retired)", err)
		}
	}
}

// recordNodeCert issues n a certificate for key and records it.
func recordNodeCert(t *testing.T, b *ca.Bundle, db *store.DB, n store.Node, key *ecdsa.PrivateKey) []byte {
	t.Helper()
	now := time.Now()
	c, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, &key.PublicKey, ca.NodeCertParams{TrustDomain: b.TrustDomain, SiteID: n.SiteID, NodeID: n.ID,
		Role: pki.RoleNode, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.InsertNodeCert(ctx, store.NodeCert{Serial: c.Serial, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Role: pki.RoleNode,
			SPKISHA256: c.SPKISHA256, DER: c.DER, NotBefore: c.Cert.NotBefore, NotAfter: c.Cert.NotAfter})
	}); err != nil {
		t.Fatal(err)
	}
	return c.DER
}
