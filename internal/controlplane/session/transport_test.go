package session_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/goroutines"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

type sessionStream = connect.BidiStreamForClient[agentv1.SessionClientMessage, agentv1.SessionServerMessage]

// openHeld opens a session as a gateway relaying der and returns it once
// Welcome arrived, with its nonce. It ends when the test does.
func openHeld(t *testing.T, b *ca.Bundle, url, nodeID string, der []byte, key *ecdsa.PrivateKey) (*sessionStream, []byte) {
	t.Helper()
	return openHeldWith(t, &http.Client{Transport: apitest.GatewayTransport(t, b)}, url, true, nodeID, der, key)
}

// openHeldWith is openHeld with client, forwarding der in
// Bc-Peer-Certificate as a gateway does when relay is set (else the
// client presents it: a daemon to a gateway).
func openHeldWith(t *testing.T, client *http.Client, url string, relay bool, nodeID string, der []byte, key *ecdsa.PrivateKey) (*sessionStream, []byte) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := agentv1connect.NewSessionServiceClient(client, url, connect.WithGRPC()).Connect(ctx)
	if relay {
		wire.SetPeerCertificate(s.RequestHeader(), der)
	}
	t.Cleanup(func() { _ = s.CloseResponse() })
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	m, err := s.Receive()
	if err != nil {
		t.Fatalf("Challenge: %v", err)
	}
	nonce := m.GetChallenge().GetNonce()
	proof, err := pki.SignSessionProof(key, nonce, nodeID, der, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof}}}); err != nil {
		t.Fatal(err)
	}
	if m, err = s.Receive(); err != nil || m.GetWelcome() == nil {
		t.Fatalf("Hello answered %v, %v; want Welcome", m, err)
	}
	return s, nonce
}

// wantEnd reads s to its end and checks the product error it ended with.
func wantEnd(t *testing.T, s *sessionStream, code errs.Code, msg string) {
	t.Helper()
	for {
		_, err := s.Receive()
		if err == nil {
			continue
		}
		var pe *errs.E
		if !errors.As(wire.FromWire(err), &pe) || pe.Code != code || pe.Message != msg {
			t.Fatalf("the session ended with %v; want %s %q", err, code, msg)
		}
		return
	}
}

// R12.1, R12.3: a session on either transport of the agent listener
// (net/http, and h2server's callbacks), opened by a gateway or by a
// daemon through a real gateway, is held, counts signed heartbeats,
// delivers a queued command at once, stores its signed result, and ends
// as the control plane ends it: a retired node is told so, and a
// shutting-down replica answers UNAVAILABLE; the node is marked
// disconnected either way.
func TestSessionOnEachTransport(t *testing.T) {
	for _, transport := range apitest.AgentTransports {
		for _, via := range []string{"gateway client", "daemon through a gateway"} {
			t.Run(transport+"/"+via, func(t *testing.T) {
				storetest.Each(t, func(t *testing.T, db *store.DB) {
					e := apitest.Start(t, db, apitest.Options{})
					url := apitest.StartAgentOn(t, e, transport)
					open := func(t *testing.T, nodeID string, der []byte, key *ecdsa.PrivateKey) (*sessionStream, []byte) {
						return openHeld(t, e.Bundle, url, nodeID, der, key)
					}
					if via != "gateway client" {
						gw := startGateway(t, e.Bundle, url)
						open = func(t *testing.T, nodeID string, der []byte, key *ecdsa.PrivateKey) (*sessionStream, []byte) {
							return openHeldWith(t, daemonClient(t, e.Bundle, der, key), gw, false, nodeID, der, key)
						}
					}
					testSession(t, e, open)
				})
			})
		}
	}
}

// startGateway runs a real gateway in front of the agent listener at url
// and returns its URL.
func startGateway(t *testing.T, b *ca.Bundle, url string) string {
	t.Helper()
	certPEM, keyPEM, err := ca.IssueGateway(b, []string{"127.0.0.1"}, time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	files := map[string][]byte{"gw.crt": certPEM, "gw.key": keyPEM, "ca.pem": pki.CertPEM(b.ServingCA)}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	g, err := gateway.New(gateway.Config{Listen: "127.0.0.1:0", CertFile: filepath.Join(dir, "gw.crt"), KeyFile: filepath.Join(dir, "gw.key"),
		APIURL: url, APICAFile: filepath.Join(dir, "ca.pem")}, gateway.Options{Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	return "https://" + apitest.ServeGateway(t, g)
}

// daemonClient is a daemon's client: its node certificate, trusting the
// serving CA (the gateway's certificate).
func daemonClient(t *testing.T, b *ca.Bundle, der []byte, key *ecdsa.PrivateKey) *http.Client {
	roots := x509.NewCertPool()
	roots.AddCert(b.ServingCA)
	tr := &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: roots,
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

// testSession runs TestSessionOnEachTransport on e with sessions opened by
// open.
func testSession(t *testing.T, e *apitest.Env, open func(t *testing.T, nodeID string, der []byte, key *ecdsa.PrivateKey) (*sessionStream, []byte)) {
	db := e.DB
	sessions := e.Server.Sessions()
	ctx := context.Background()
	n := storetest.Node(t, db, store.NodeAdopted)
	key, der := nodeCert(t, e.Bundle, db, n, `[]`)
	s, nonce := open(t, n.ID, der, key)
	if !sessions.Connected(n.ID) {
		t.Fatal("a welcomed session is not held")
	}
	sig, err := pki.SignHeartbeat(key, nonce, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{Seq: 1, Sig: sig}}}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.InsertCommand(ctx, store.Command{ID: "cmd_" + n.ID, NodeID: n.ID, IdentityGeneration: n.IdentityGeneration, Kind: "node.facts",
			CreatedAt: now, ExpiresAt: now.Add(time.Hour)})
	}); err != nil {
		t.Fatal(err)
	}
	sessions.Notify(n.ID)
	m, err := s.Receive()
	if err != nil || m.GetCommand() == nil {
		t.Fatalf("got %v, %v; want the queued command", m, err)
	}
	var body agentv1.CommandBody
	if err := proto.Unmarshal(m.GetCommand().GetBody(), &body); err != nil || body.GetCommandId() != "cmd_"+n.ID {
		t.Fatalf("command body %v, %v", &body, err)
	}
	out := []byte(`{"cpus":4}`)
	rsig, err := pki.SignCommandResult(key, pki.CommandResult{CommandID: body.GetCommandId(), NodeID: n.ID, IdentityGeneration: int64(n.IdentityGeneration), OK: true, Output: out})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: &agentv1.CommandResult{
		CommandId: body.GetCommandId(), Ok: true, Output: out, Sig: rsig}}}); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, 10*time.Second, "the command's result stored", func() bool {
		var c store.Command
		_ = db.ReadTx(ctx, func(tx *store.Tx) (err error) { c, err = tx.GetCommand(ctx, body.GetCommandId()); return })
		return c.State == store.CommandDone
	})

	sessions.EndNode(n.ID, session.EndRetired)
	wantEnd(t, s, errs.InvalidState, wire.NodeRetiredMessage)
	poll.Until(t, 10*time.Second, "the node marked disconnected", func() bool {
		var got store.Node
		_ = db.ReadTx(ctx, func(tx *store.Tx) (err error) { got, err = tx.GetNode(ctx, n.ID); return })
		return !sessions.Connected(n.ID) && got.Connection == store.Disconnected
	})

	other := storetest.Node(t, db, store.NodeAdopted)
	okey, oder := nodeCert(t, e.Bundle, db, other, `[]`)
	s2, _ := open(t, other.ID, oder, okey)
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := sessions.Close(cctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	wantEnd(t, s2, errs.Unavailable, "the control plane is shutting down; reconnect")
	if sessions.Connected(other.ID) {
		t.Error("a session is held after Close returned")
	}
}

// The two transports answer a refused session alike, byte for byte: the
// same response headers (but Date, which net/http adds) and the same
// trailers, grpc-status-details-bin (the product's ErrorDetail) included,
// so the gateway and bcd read the same errors from either.
func TestSessionRefusalSameOnEachTransport(t *testing.T) {
	db := storetest.OpenSQLite(t)
	e := apitest.Start(t, db, apitest.Options{})
	n := storetest.Node(t, db, store.NodeAdopted)
	_, der := nodeCert(t, e.Bundle, db, n, `[]`)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	stray, err := ca.SignNodeCertKey(e.Bundle.NodeCA, e.Bundle.NodeCAKey, &key.PublicKey, ca.NodeCertParams{TrustDomain: e.Bundle.TrustDomain, SiteID: n.SiteID, NodeID: n.ID,
		Role: pki.RoleNode, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	urls := map[string]string{}
	for _, transport := range apitest.AgentTransports {
		urls[transport] = apitest.StartAgentOn(t, e, transport)
	}
	tr := apitest.GatewayTransport(t, e.Bundle)
	for _, tc := range []struct {
		name   string
		der    []byte
		status string
	}{
		{name: "no certificate", status: "7"},
		{name: "a certificate not on record", der: stray.DER, status: "7"},
		{name: "no Hello after the Challenge", der: der, status: "7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var first http.Header
			var firstTrailer http.Header
			for _, transport := range apitest.AgentTransports {
				req, err := http.NewRequest(http.MethodPost, urls[transport]+agentv1connect.SessionServiceConnectProcedure, http.NoBody)
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set("Content-Type", "application/grpc")
				req.Header.Set("Te", "trailers")
				if tc.der != nil {
					wire.SetPeerCertificate(req.Header, tc.der)
				}
				res, err := tr.RoundTrip(req)
				if err != nil {
					t.Fatalf("%s: %v", transport, err)
				}
				_, _ = io.Copy(io.Discard, res.Body)
				res.Body.Close()
				h := res.Header.Clone()
				h.Del("Date")
				if res.StatusCode != http.StatusOK || res.Trailer.Get("Grpc-Status") != tc.status || res.Trailer.Get("Grpc-Status-Details-Bin") == "" {
					t.Fatalf("%s: %d %v %v; want 200, grpc-status %s with details", transport, res.StatusCode, h, res.Trailer, tc.status)
				}
				if first == nil {
					first, firstTrailer = h, res.Trailer
					continue
				}
				if !maps.EqualFunc(first, h, slices.Equal) {
					t.Errorf("headers: %s %v, %s %v", apitest.AgentTransports[0], first, transport, h)
				}
				if !maps.EqualFunc(firstTrailer, res.Trailer, slices.Equal) {
					t.Errorf("trailers: %s %v, %s %v", apitest.AgentTransports[0], firstTrailer, transport, res.Trailer)
				}
			}
		})
	}
}

// R12.1: on either transport a session ends as Connect ends it: a daemon
// silent after the Challenge is refused after the Hello timeout
// (hello-timeout), a retired node that proves its key is told so, a heartbeat that does not verify ends the session
// (heartbeat-signature), a message over the listener's limit ends it as
// an unreadable stream, and a daemon that goes away leaves its node
// marked disconnected.
func TestSessionEndsOnEachTransport(t *testing.T) {
	for _, transport := range apitest.AgentTransports {
		t.Run(transport, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			fc := clock.NewFake(time.Now())
			e := apitest.Start(t, db, apitest.Options{Clock: fc})
			url := apitest.StartAgentOn(t, e, transport)
			ctx := context.Background()

			t.Run("no Hello", func(t *testing.T) {
				n := storetest.Node(t, db, store.NodeAdopted)
				_, der := nodeCert(t, e.Bundle, db, n, `[]`)
				helloTimesOut(t, e.Bundle, fc, url, der)
				waitRefusal(t, db, n.TenantID, n.ID, "hello-timeout")
			})
			t.Run("a heartbeat not signed by the node", func(t *testing.T) {
				n := storetest.Node(t, db, store.NodeAdopted)
				key, der := nodeCert(t, e.Bundle, db, n, `[]`)
				forgedHeartbeatEnds(t, e.Bundle, url, n, der, key)
				waitRefusal(t, db, n.TenantID, n.ID, "heartbeat-signature")
			})
			t.Run("a retired node that proves its key", func(t *testing.T) {
				n := storetest.Node(t, db, store.NodeAdopted)
				key, der := nodeCert(t, e.Bundle, db, n, `[]`)
				if err := db.WithTx(ctx, func(tx *store.Tx) error { return tx.SetNodeState(ctx, n.ID, store.NodeRetired, "test") }); err != nil {
					t.Fatal(err)
				}
				m, err := hello(t, e.Bundle, url, n.ID, der, key)
				var pe *errs.E
				if !errors.As(wire.FromWire(err), &pe) || pe.Code != errs.InvalidState || pe.Message != wire.NodeRetiredMessage {
					t.Fatalf("Hello answered %v, %v; want INVALID_STATE %q", m, err, wire.NodeRetiredMessage)
				}
			})
			t.Run("a message over the limit", func(t *testing.T) {
				n := storetest.Node(t, db, store.NodeAdopted)
				key, der := nodeCert(t, e.Bundle, db, n, `[]`)
				s, _ := openHeld(t, e.Bundle, url, n.ID, der, key)
				big := &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{Seq: 1, Sig: make([]byte, 65<<10)}}}
				if err := s.Send(big); err != nil && !errors.Is(err, io.EOF) {
					t.Fatal(err)
				}
				// The stream cannot be read further: the session ends as
				// when the daemon leaves (Connect's Receive fails).
				for {
					if _, err := s.Receive(); err != nil {
						if !errors.Is(err, io.EOF) {
							t.Fatalf("the session ended with %v, want its end", err)
						}
						break
					}
				}
				poll.Until(t, 10*time.Second, "the node marked disconnected", func() bool {
					var got store.Node
					_ = db.ReadTx(ctx, func(tx *store.Tx) (err error) { got, err = tx.GetNode(ctx, n.ID); return })
					return !e.Server.Sessions().Connected(n.ID) && got.Connection == store.Disconnected
				})
			})
			t.Run("the daemon goes away", func(t *testing.T) {
				n := storetest.Node(t, db, store.NodeAdopted)
				key, der := nodeCert(t, e.Bundle, db, n, `[]`)
				s, _ := openHeld(t, e.Bundle, url, n.ID, der, key)
				_ = s.CloseRequest()
				_ = s.CloseResponse()
				poll.Until(t, 10*time.Second, "the node marked disconnected", func() bool {
					var got store.Node
					_ = db.ReadTx(ctx, func(tx *store.Tx) (err error) { got, err = tx.GetNode(ctx, n.ID); return })
					return !e.Server.Sessions().Connected(n.ID) && got.Connection == store.Disconnected
				})
			})
		})
	}
}

// R12.1: on either transport a daemon that offers a heartbeat key agrees
// one ([session] heartbeat_mac), its heartbeats MAC'd under it count, and
// the session stays held until the control plane ends it.
func TestSessionHeartbeatMACOnEachTransport(t *testing.T) {
	for _, transport := range apitest.AgentTransports {
		t.Run(transport, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			reg := prometheus.NewRegistry()
			e := apitest.Start(t, db, apitest.Options{HeartbeatMAC: true, Metrics: apimetrics.NewAPI(reg)})
			url := apitest.StartAgentOn(t, e, transport)
			n := storetest.Node(t, db, store.NodeAdopted)
			key, der := nodeCert(t, e.Bundle, db, n, `[]`)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s := agentv1connect.NewSessionServiceClient(&http.Client{Transport: apitest.GatewayTransport(t, e.Bundle)}, url, connect.WithGRPC()).Connect(ctx)
			wire.SetPeerCertificate(s.RequestHeader(), der)
			defer s.CloseResponse()
			if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			m, err := s.Receive()
			if err != nil {
				t.Fatal(err)
			}
			nonce := m.GetChallenge().GetNonce()
			share, err := pki.NewHeartbeatKeyShare()
			if err != nil {
				t.Fatal(err)
			}
			daemonKey := share.PublicKey().Bytes()
			proof, err := pki.SignSessionProof(key, nonce, n.ID, der, daemonKey)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: &agentv1.Hello{Protocol: 1, Proof: proof, HeartbeatKey: daemonKey}}}); err != nil {
				t.Fatal(err)
			}
			if m, err = s.Receive(); err != nil || len(m.GetWelcome().GetHeartbeatKey()) == 0 {
				t.Fatalf("Hello answered %v, %v; want Welcome with the API's heartbeat key", m, err)
			}
			k, err := pki.DeriveHeartbeatKey(share, pki.HeartbeatKeyParams{Nonce: nonce, NodeID: n.ID, CertDER: der, DaemonKey: daemonKey, APIKey: m.GetWelcome().GetHeartbeatKey()})
			if err != nil {
				t.Fatal(err)
			}
			mac := pki.NewHeartbeatMAC(k, nonce)
			const beats = 3
			for seq := uint64(1); seq <= beats; seq++ {
				if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{Seq: seq, Mac: mac.Sum(seq)}}}); err != nil {
					t.Fatal(err)
				}
			}
			poll.Until(t, 10*time.Second, "the heartbeats verified", func() bool { return heartbeats(t, reg) == beats })
			e.Server.Sessions().EndNode(n.ID, session.EndRetired)
			wantEnd(t, s, errs.InvalidState, wire.NodeRetiredMessage)
		})
	}
}

// heartbeats reads the verified heartbeats counter from reg.
func heartbeats(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == telemetry.SessionHeartbeats {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}

// R12.1: a session's handler on net/http returns only once the goroutines
// it started to read the stream ended, however the session ends: refused
// for want of a Hello (its read of Hello still waiting) or for a
// heartbeat the node did not sign (its read loop still waiting), or left
// by the daemon.
func TestSessionHandlerJoinsItsReaders(t *testing.T) {
	db := storetest.OpenSQLite(t)
	fc := clock.NewFake(time.Now())
	e := apitest.Start(t, db, apitest.Options{Clock: fc})
	agent := e.Server.AgentHandler()
	// returned names, by the certificate it relayed, each session whose
	// handler returned.
	returned := make(chan string, 16)
	url := apitest.StartAgent(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		agent.ServeHTTP(w, r)
		if r.URL.Path == agentv1connect.SessionServiceConnectProcedure {
			select {
			case returned <- string(wire.PeerCertificate(r.Header)):
			default:
			}
		}
	}), e.Bundle).URL
	// A session held throughout keeps the held-session check running, so
	// that the goroutines new in each case are the case's own.
	n := storetest.Node(t, db, store.NodeAdopted)
	key, der := nodeCert(t, e.Bundle, db, n, `[]`)
	openHeld(t, e.Bundle, url, n.ID, der, key)
	for _, tc := range []struct {
		name string
		end  func(t *testing.T, n store.Node, der []byte, key *ecdsa.PrivateKey)
	}{
		{name: "no Hello", end: func(t *testing.T, n store.Node, der []byte, _ *ecdsa.PrivateKey) {
			helloTimesOut(t, e.Bundle, fc, url, der)
		}},
		{name: "a heartbeat not signed by the node", end: func(t *testing.T, n store.Node, der []byte, key *ecdsa.PrivateKey) {
			forgedHeartbeatEnds(t, e.Bundle, url, n, der, key)
		}},
		{name: "the daemon goes away", end: func(t *testing.T, n store.Node, der []byte, key *ecdsa.PrivateKey) {
			s, _ := openHeld(t, e.Bundle, url, n.ID, der, key)
			_ = s.CloseRequest()
			_ = s.CloseResponse()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := storetest.Node(t, db, store.NodeAdopted)
			key, der := nodeCert(t, e.Bundle, db, n, `[]`)
			before := goroutines.Take()
			tc.end(t, n, der, key)
			for done := false; !done; {
				select {
				case got := <-returned:
					done = got == string(der)
				case <-time.After(30 * time.Second):
					t.Fatal("the session's handler did not return")
				}
			}
			goroutines.Joined(t, before, "internal/controlplane/session.")
		})
	}
}

// helloTimesOut opens a session on url with der and sends no Hello: once
// fc passes the Hello timeout the session is refused.
func helloTimesOut(t *testing.T, b *ca.Bundle, fc *clock.Fake, url string, der []byte) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := agentv1connect.NewSessionServiceClient(&http.Client{Transport: apitest.GatewayTransport(t, b)}, url, connect.WithGRPC()).Connect(ctx)
	wire.SetPeerCertificate(s.RequestHeader(), der)
	defer s.CloseResponse()
	if err := s.Send(nil); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if m, err := s.Receive(); err != nil || m.GetChallenge() == nil {
		t.Fatalf("got %v, %v; want the Challenge", m, err)
	}
	timeout := fc.Now().Add(30 * time.Second)
	poll.Until(t, 10*time.Second, "the Hello timeout armed", func() bool {
		return slices.ContainsFunc(fc.Deadlines(), func(d time.Time) bool { return !d.Before(timeout) })
	})
	fc.Advance(30 * time.Second)
	wantEnd(t, s, errs.AccessDenied, "Session refused")
}

// forgedHeartbeatEnds holds a session of n on url and sends a heartbeat
// signed by another key than the node's: the session is refused.
func forgedHeartbeatEnds(t *testing.T, b *ca.Bundle, url string, n store.Node, der []byte, key *ecdsa.PrivateKey) {
	t.Helper()
	s, nonce := openHeld(t, b, url, n.ID, der, key)
	other, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := pki.SignHeartbeat(other, nonce, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{Seq: 1, Sig: sig}}}); err != nil {
		t.Fatal(err)
	}
	wantEnd(t, s, errs.AccessDenied, "Session refused")
}
