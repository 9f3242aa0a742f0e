package session_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// R12.3, R7.5: a session fails closed on its certificate's allowed kinds.
// No restriction ([] or absent) and a list are told to the gateway in
// Welcome; a value the server cannot read as a list of kinds refuses the
// session (ACCESS_DENIED "Session refused", security.session.refused with
// reason allowed-kinds-unreadable) instead of lifting the restriction.
func TestSessionAllowedKindsFailClosed(t *testing.T) {
	tests := []struct {
		name   string
		stored string // node_certs.allowed_kinds as the row holds it
		want   []string
		refuse bool
	}{
		{name: "no restriction", stored: `[]`},
		{name: "absent", stored: `null`},
		{name: "a list", stored: `["node.*","acceptance.check"]`, want: []string{"node.*", "acceptance.check"}},
		{name: "not JSON", stored: `node.*`, refuse: true},
		{name: "truncated", stored: `["node.*"`, refuse: true},
		{name: "an object", stored: `{"kinds":["node.*"]}`, refuse: true},
		{name: "not strings", stored: `[1,2]`, refuse: true},
	}
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		e := apitest.Start(t, db, apitest.Options{})
		for _, transport := range apitest.AgentTransports {
			agent := apitest.StartAgentOn(t, e, transport)
			for _, tc := range tests {
				t.Run(transport+"/"+tc.name, func(t *testing.T) {
					n := storetest.Node(t, db, store.NodeAdopted)
					key, der := nodeCert(t, e.Bundle, db, n, tc.stored)
					m, err := hello(t, e.Bundle, agent, n.ID, der, key)
					if tc.refuse {
						if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "Session refused") {
							t.Fatalf("Hello answered %v, %v; want ACCESS_DENIED Session refused", m, err)
						}
						waitRefusal(t, db, n.TenantID, n.ID, "allowed-kinds-unreadable")
						return
					}
					if err != nil || m.GetWelcome() == nil {
						t.Fatalf("Hello answered %v, %v; want Welcome", m, err)
					}
					if got := m.GetWelcome().GetAllowedKinds(); !slices.Equal(got, tc.want) {
						t.Errorf("Welcome.allowed_kinds = %q, want %q", got, tc.want)
					}
				})
			}
		}
	})
}

// nodeCert issues a certificate for n from the bundle's node CA and records
// it with allowed_kinds stored verbatim.
func nodeCert(t *testing.T, b *ca.Bundle, db *store.DB, n store.Node, kinds string) (*ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	c, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, &key.PublicKey, ca.NodeCertParams{TrustDomain: b.TrustDomain, SiteID: n.SiteID, NodeID: n.ID,
		Role: pki.RoleNode, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	err = db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.InsertNodeCert(ctx, store.NodeCert{Serial: c.Serial, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Role: pki.RoleNode,
			SPKISHA256: c.SPKISHA256, DER: c.DER, AllowedKinds: []byte(kinds), NotBefore: c.Cert.NotBefore, NotAfter: c.Cert.NotAfter})
	})
	if err != nil {
		t.Fatalf("record the certificate: %v", err)
	}
	return key, c.DER
}

// hello opens a session on the agent listener as a gateway relaying der,
// answers the Challenge with a proof by key, and returns the answer to
// Hello.
func hello(t *testing.T, b *ca.Bundle, url, nodeID string, der []byte, key *ecdsa.PrivateKey) (*agentv1.SessionServerMessage, error) {
	t.Helper()
	tr := apitest.GatewayTransport(t, b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := agentv1connect.NewSessionServiceClient(&http.Client{Transport: tr}, url, connect.WithGRPC()).Connect(ctx)
	wire.SetPeerCertificate(s.RequestHeader(), der)
	defer s.CloseResponse()
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	m, err := s.Receive()
	if err != nil {
		return nil, err
	}
	proof, err := pki.SignSessionProof(key, m.GetChallenge().GetNonce(), nodeID, der, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof}}}); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return s.Receive()
}

// waitRefusal waits for the security.session.refused event naming node and
// reason in tenant's stream (on PostgreSQL an event is listed once the
// sequencer ordered it).
func waitRefusal(t *testing.T, db *store.DB, tenantID, nodeID, reason string) {
	t.Helper()
	ctx := context.Background()
	poll.Until(t, 10*time.Second, "a security.session.refused event for "+nodeID+" with reason "+reason, func() bool {
		var evs []store.Event
		err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			evs, err = tx.ListEvents(ctx, tenantID, 0, 0, "security.session.refused", 100)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs {
			if strings.Contains(string(ev.Data), `"reason":"`+reason+`"`) && strings.Contains(string(ev.Data), `"nodeId":"`+nodeID+`"`) {
				return true
			}
		}
		return false
	})
}
