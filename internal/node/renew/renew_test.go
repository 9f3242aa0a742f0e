package renew_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	bcdjointest "github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/gateway"
	bcdcli "github.com/better-compute/better-compute/internal/node/bcdcmd"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// stack is the real control plane in-process: the API (apitest, real
// database) with its agent listener (mTLS, the serving CA), a real gateway
// in front of it, and a bcd that joined through the gateway.
type stack struct {
	e          *apitest.Env
	gatewayURL string
	calls      atomic.Int64 // calls that reached the agent listener
	cfg        *bcdconfig.Config
	configPath string
	store      *identity.Store
	joined     *identity.Identity
	joinErr    error
}

// noProxy is the HTTP client bcd uses in these tests: the pinned TLS
// configuration as given, and no proxy from the environment.
func noProxy(c *tls.Config) *http.Client {
	return &http.Client{Transport: &http.Transport{TLSClientConfig: c, ForceAttemptHTTP2: true}}
}

func newStack(t *testing.T, e *apitest.Env) *stack { return newStackWith(t, e, stackOptions{}) }

// stackOptions varies the stack.
type stackOptions struct {
	// sim, when set, is the machine's TPM (R9): the API also runs the tpm
	// attestor, trusting the EKs its local CA certified for the pool, and
	// bcd keeps its node keys in it and joins with --attestor tpm.
	sim *tpmtest.Sim
	// token, with sim, joins with the token all the same.
	token bool
	// joinClock, when set, is bcd's clock for the join, and a failed join
	// is kept in stack.joinErr instead of failing the test (R19.3).
	joinClock clock.Clock
}

func newStackWith(t *testing.T, e *apitest.Env, o stackOptions) *stack {
	t.Helper()
	ctx := context.Background()
	s := &stack{e: e}
	b := e.Bundle
	now := time.Now()
	dir := t.TempDir()

	// A site, a bcd pool and a token, through the operator API.
	site, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
	if err != nil {
		t.Fatal(err)
	}
	pool, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: site.Msg.Id, Name: "gpu", Agent: "bcd"}))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, TtlSeconds: 3600}))
	if err != nil {
		t.Fatal(err)
	}

	// The API's agent listener, as server.Run serves it.
	apiPEM, apiKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	apiPair, err := tls.X509KeyPair(apiPEM, apiKey)
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AddCert(b.ServingCA)
	agent := e.Server.AgentHandler()
	if o.sim != nil {
		agent = tpmAgent(t, e, pool.Msg.Id, o.sim)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.calls.Add(1)
		agent.ServeHTTP(w, r)
	}))
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{apiPair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)

	// The gateway.
	gwPEM, gwKey, err := ca.IssueGateway(b, []string{"127.0.0.1"}, now, 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	g, err := gateway.New(gateway.Config{
		Listen: "127.0.0.1:0", CertFile: write("gateway.crt", gwPEM), KeyFile: write("gateway.key", gwKey),
		APIURL: srv.URL, APICAFile: write("serving-ca.pem", pki.CertPEM(b.ServingCA)),
	}, gateway.Options{Log: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- g.Serve(ln) }()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = g.Shutdown(sctx)
		<-done
	})
	s.gatewayURL = "https://" + ln.Addr().String()

	// bcd's configuration, as the install script writes it.
	pins, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	root := filepath.Join(dir, "host")
	s.cfg = &bcdconfig.Config{
		GatewayURL: s.gatewayURL, Site: site.Msg.Id,
		ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption,
		DataDir:   filepath.Join(root, "var", "lib", "bcd"),
		SysfsRoot: bcdjointest.FakeSysfs(t, filepath.Join(root, "sys")), ProcfsRoot: filepath.Join(root, "proc"),
		TPM: bcdconfig.TPM{Mode: bcdconfig.TPMOff},
	}
	if o.sim != nil {
		s.cfg.TPM = bcdconfig.TPM{Mode: bcdconfig.TPMRequired, Simulator: o.sim.Addr}
	}
	etc := filepath.Join(root, "etc", "bcd")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	s.configPath = filepath.Join(etc, "config.toml")
	if err := s.cfg.Write(s.configPath); err != nil {
		t.Fatal(err)
	}
	if err := bcdconfig.WriteEncryptionKey(etc, pins.JoinEncryption, &b.JoinEncryptionKey.PublicKey); err != nil {
		t.Fatal(err)
	}
	s.join(t, tok.Msg.Token, o)
	return s
}

// join joins bcd through the gateway: with token, or with the TPM.
func (s *stack) join(t *testing.T, token string, o stackOptions) {
	t.Helper()
	ctx := context.Background()
	keys, st, err := tpmkeys.Stores(s.cfg, s.cfg.DataDir)
	if err != nil {
		t.Fatal(err)
	}
	s.store = st
	j, err := enroll.New(enroll.Config{BCD: s.cfg, ConfigPath: s.configPath, Store: s.store, Keys: keys, HTTPClient: noProxy, Log: quiet, Clock: o.joinClock})
	if err != nil {
		t.Fatal(err)
	}
	opts := enroll.Options{Token: token}
	if o.sim != nil && !o.token {
		opts = enroll.Options{Attestor: identity.AttestorTPM}
	}
	if s.joined, err = j.Join(ctx, opts); err != nil {
		if o.joinClock != nil {
			s.joinErr = err
			return
		}
		t.Fatalf("bcd join: %v", err)
	}
}

func (s *stack) renewer(t *testing.T, mod func(c *renew.Config)) *renew.Renewer {
	t.Helper()
	c := renew.Config{BCD: s.cfg, Store: s.store, HTTPClient: noProxy, Log: quiet}
	if mod != nil {
		mod(&c)
	}
	r, err := renew.New(c)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (s *stack) certs(t *testing.T, nodeID string) []store.NodeCert {
	t.Helper()
	var out []store.NodeCert
	err := s.e.DB.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
		out, err = tx.ListNodeCerts(context.Background(), nodeID, 100)
		return
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func keyOf(t *testing.T, id *identity.Identity) *ecdsa.PublicKey {
	t.Helper()
	return id.Leaf().PublicKey.(*ecdsa.PublicKey)
}

// R13.1, R13.2: bcd renews through the real gateway and API: its current
// certificate is its mTLS identity, the answer is checked like a join
// answer, and the saved identity is the same node with a new key and
// certificate of the same generation and role. `bcd renew` does the same.
func TestRenewThroughGatewayR13_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		old := s.joined

		got, err := s.renewer(t, nil).RenewOnce(context.Background())
		if err != nil {
			t.Fatalf("RenewOnce: %v", err)
		}
		loaded, err := s.store.Load()
		if err != nil {
			t.Fatalf("the renewed identity does not load: %v", err)
		}
		if loaded.Serial != got.Serial || loaded.Serial == old.Serial {
			t.Fatalf("serial %s (returned %s), old %s: want a new certificate saved", loaded.Serial, got.Serial, old.Serial)
		}
		if keyOf(t, loaded).Equal(keyOf(t, old)) {
			t.Error("the renewed certificate is for the old key")
		}
		if loaded.NodeID != old.NodeID || loaded.SiteID != old.SiteID || loaded.Role != old.Role || loaded.SPIFFEID != old.SPIFFEID ||
			loaded.Attestor != old.Attestor || !loaded.JoinedAt.Equal(old.JoinedAt) {
			t.Errorf("renewed identity %+v, want the node of %+v", loaded, old)
		}
		// R12.3: the generation from the signed answers, kept with the identity.
		if old.IdentityGeneration != 1 || loaded.IdentityGeneration != 1 {
			t.Errorf("generation joined %d, renewed %d; want 1", old.IdentityGeneration, loaded.IdentityGeneration)
		}
		certs := s.certs(t, old.NodeID)
		if len(certs) != 2 {
			t.Fatalf("%d node_certs rows, want 2", len(certs))
		}
		for _, c := range certs {
			if c.IdentityGeneration != 1 || c.Role != old.Role {
				t.Errorf("cert %s generation %d role %s", c.Serial, c.IdentityGeneration, c.Role)
			}
		}

		// An identity saved by a bcd that did not keep the generation
		// learns it at its next renewal (R12.3).
		metaPath := filepath.Join(s.store.Dir, identity.IdentityFile)
		raw, err := os.ReadFile(metaPath)
		if err != nil {
			t.Fatal(err)
		}
		var meta map[string]any
		if err := json.Unmarshal(raw, &meta); err != nil {
			t.Fatal(err)
		}
		delete(meta, "identity_generation")
		if raw, err = json.Marshal(meta); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(metaPath, raw, 0o644); err != nil {
			t.Fatal(err)
		}
		if legacy, err := s.store.Load(); err != nil || legacy.IdentityGeneration != 0 {
			t.Fatalf("legacy identity: %v", err)
		}

		// bcd renew --json, with the renewed identity as mTLS identity.
		var stdout, stderr bytes.Buffer
		code := bcdcli.Main(context.Background(), []string{"renew", "--config", s.configPath, "--json"},
			bcdcli.Env{Stdout: &stdout, Stderr: &stderr, HTTPClient: noProxy})
		if code != 0 {
			t.Fatalf("bcd renew: exit %d: %s", code, stderr.String())
		}
		var st bcdcli.Status
		if err := json.Unmarshal(stdout.Bytes(), &st); err != nil {
			t.Fatalf("bcd renew --json: %v: %s", err, stdout.String())
		}
		again, err := s.store.Load()
		if err != nil {
			t.Fatal(err)
		}
		if st.Serial != again.Serial || st.Serial == loaded.Serial || st.NodeID != old.NodeID || !st.Joined {
			t.Errorf("bcd renew printed %+v; saved serial %s, previous %s", st, again.Serial, loaded.Serial)
		}
		if again.IdentityGeneration != 1 {
			t.Errorf("the legacy identity renewed with generation %d, want 1", again.IdentityGeneration)
		}
		if n := len(s.certs(t, old.NodeID)); n != 3 {
			t.Errorf("%d node_certs rows, want 3", n)
		}
	})
}

// R13.5 through the gateway: a refused renewal is ACCESS_DENIED "Renew
// refused" for bcd, which keeps its identity; the reason is in the owner's
// events.
func TestRenewRefusedThroughGatewayR13_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		err := e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
			return tx.SetNodeState(context.Background(), s.joined.NodeID, store.NodeRetired, "test")
		})
		if err != nil {
			t.Fatal(err)
		}
		_, err = s.renewer(t, nil).RenewOnce(context.Background())
		if ee, ok := errs.As(err); !ok || ee.Code != errs.AccessDenied {
			t.Fatalf("got %v, want ACCESS_DENIED", err)
		}
		cur, lerr := s.store.Load()
		if lerr != nil || cur.Serial != s.joined.Serial {
			t.Fatalf("identity after a refusal: %v, serial %v; want the old one kept", lerr, cur)
		}
		got := jointest.RenewRefusals(t, e.DB, e.RootTenant)
		if len(got) != 1 || got[0].Reason != "node-retired" || got[0].NodeID != s.joined.NodeID {
			t.Errorf("refusals %+v, want one node-retired", got)
		}
	})
}

// R13.3, R20.1: a certificate naming a TPM attestation key is not renewed
// without the TPM's attestation: bcd fails loudly and sends nothing, whichever
// SVID form carries the statement (a second URI SAN, or the strict form's
// extension).
func TestRenewTPMKeyFailsWithoutSendingR13_3(t *testing.T) {
	for _, strict := range []bool{false, true} {
		t.Run(map[bool]string{false: "page", true: "spiffe-strict"}[strict], func(t *testing.T) {
			apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
				s := newStack(t, e)
				b := e.Bundle
				id := s.joined
				nb := time.Now().Add(-time.Minute)
				nc, err := ca.SignNodeCertKey(b.NodeCA, b.NodeCAKey, keyOf(t, id), ca.NodeCertParams{
					TrustDomain: b.TrustDomain, SiteID: id.SiteID, NodeID: id.NodeID, Role: id.Role,
					Statements: []string{"urn:bc:tpm-ak:sha256:0a0b"}, NotBefore: nb, NotAfter: nb.Add(time.Hour), StatementsInExtension: strict,
				})
				if err != nil {
					t.Fatal(err)
				}
				chainPEM := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: nc.DER}), pki.CertPEM(b.NodeCA)...)
				keyRecord, err := os.ReadFile(filepath.Join(s.store.Dir, identity.KeyFile))
				if err != nil {
					t.Fatal(err)
				}
				bundlePEM, err := os.ReadFile(filepath.Join(s.store.Dir, identity.BundleFile))
				if err != nil {
					t.Fatal(err)
				}
				tpmID, err := identity.NewIdentity(chainPEM, id.Attestor, id.JoinedAt)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.store.Save(tpmID, keyRecord, chainPEM, bundlePEM); err != nil {
					t.Fatal(err)
				}
				before := s.calls.Load()
				_, err = s.renewer(t, nil).RenewOnce(context.Background())
				if ee, ok := errs.As(err); !ok || ee.Code != errs.InvalidState {
					t.Fatalf("got %v, want INVALID_STATE", err)
				}
				if n := s.calls.Load() - before; n != 0 {
					t.Errorf("%d calls reached the API, want none", n)
				}
			})
		})
	}
}

// R13.1: Loop sleeps until 60% of the lifetime (jitter injected), renews,
// and sleeps until the next renewal; it stops when ctx ends.
func TestLoopRenewsWhenDueR13_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var waits []time.Duration
		var told []string
		r := s.renewer(t, func(c *renew.Config) {
			c.OnRenewed = func(id *identity.Identity) { told = append(told, id.Serial) }
			c.Rand = func() float64 { return 0.5 }
			c.Sleep = func(ctx context.Context, d time.Duration) error {
				waits = append(waits, d)
				if len(waits) == 2 {
					cancel()
				}
				return ctx.Err()
			}
		})
		err := r.Loop(ctx)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Loop: %v, want context.Canceled", err)
		}
		leaf := s.joined.Leaf()
		due := leaf.NotBefore.Add(time.Duration(0.6 * float64(leaf.NotAfter.Sub(leaf.NotBefore))))
		if len(waits) != 2 || waits[0] > time.Until(due)+time.Second || waits[0] < time.Until(due)-time.Minute {
			t.Fatalf("waits %v, want first about %s", waits, time.Until(due))
		}
		cur, err := s.store.Load()
		if err != nil || cur.Serial == s.joined.Serial {
			t.Fatalf("after one round: %v; want a renewed identity", err)
		}
		// R19.3: the session is told of the renewal, with the new identity.
		if len(told) != 1 || told[0] != cur.Serial {
			t.Fatalf("OnRenewed told %v, want once with %s", told, cur.Serial)
		}
	})
}

// R13.1: a failing renewal is retried with exponential backoff from 1 s to
// 5 min, and the identity is kept.
func TestLoopBacksOffR13_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		cfg := *s.cfg
		cfg.GatewayURL = deadGateway(t)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var waits []time.Duration
		r := s.renewer(t, func(c *renew.Config) {
			c.BCD = &cfg
			c.Rand = func() float64 { return 0.5 } // the jitter's middle: the backoff itself
			c.Sleep = func(ctx context.Context, d time.Duration) error {
				waits = append(waits, d)
				if len(waits) == 12 {
					cancel()
				}
				return ctx.Err()
			}
		})
		if err := r.Loop(ctx); !errors.Is(err, context.Canceled) {
			t.Fatalf("Loop: %v", err)
		}
		want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second,
			64 * time.Second, 128 * time.Second, 256 * time.Second, 5 * time.Minute, 5 * time.Minute}
		if len(waits) != 12 {
			t.Fatalf("waits %v", waits)
		}
		for i, w := range want {
			if waits[i+1] != w {
				t.Fatalf("waits %v, want %v after the first", waits, want)
			}
		}
		if cur, err := s.store.Load(); err != nil || cur.Serial != s.joined.Serial {
			t.Fatalf("identity after failures: %v; want the old one kept", err)
		}
	})
}

// deadGateway is a gateway that is down: it drops every connection. The
// listener stays open until the test ends, so no other process can take
// the port (never close a listener and dial its port).
func deadGateway(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var accepting sync.WaitGroup
	t.Cleanup(func() { ln.Close(); accepting.Wait() })
	accepting.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	})
	return "https://" + ln.Addr().String()
}

// R13.1: a renewal that keeps failing is retried until the certificate
// expired, never waiting past the expiry: near it the backoff gives way to
// a share of what is left (at least MinBackoff), and Loop ends with the
// expiry only once the certificate expired, on the injected clock.
func TestLoopRetriesUntilExpiryR13_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		s := newStack(t, e)
		cfg := *s.cfg
		cfg.GatewayURL = deadGateway(t)
		notAfter := s.joined.NotAfter
		fc := clock.NewFake(notAfter.Add(-2 * time.Minute))
		var waits []time.Duration
		r := s.renewer(t, func(c *renew.Config) {
			c.BCD, c.Clock = &cfg, fc
			c.Rand = func() float64 { return 0.5 }
			c.Sleep = func(ctx context.Context, d time.Duration) error {
				if len(waits) > 0 { // the first is the wait for the due time
					if left := notAfter.Sub(fc.Now()); d > left && d > renew.MinBackoff {
						t.Errorf("wait %s with %s left before the expiry", d, left)
					}
				}
				waits = append(waits, d)
				fc.Advance(d)
				return ctx.Err()
			}
		})
		err := r.Loop(context.Background())
		if e, ok := errs.As(err); !ok || e.Code != errs.InvalidState || !fc.Now().After(notAfter) {
			t.Fatalf("Loop: %v at %s (expiry %s), want the expiry error once expired", err, fc.Now(), notAfter)
		}
		want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second}
		if len(waits) < len(want)+3 {
			t.Fatalf("waits %v: want the backoff, then ever shorter waits before the expiry", waits)
		}
		for i, w := range want {
			if waits[i+1] != w {
				t.Fatalf("waits %v, want %v after the first", waits, want)
			}
		}
		if last := waits[len(waits)-1]; last != renew.MinBackoff {
			t.Errorf("last wait %s, want %s", last, renew.MinBackoff)
		}
	})
}

// R13.1: the renewal is due at NotBefore plus a share of the lifetime drawn
// uniformly from 45% to 75% (about 60% on average), whatever the lifetime:
// the jitter's ends and middle land exactly there, and a sweep of the
// jitter stays within the window, ordered, with its mean at 60%.
func TestNextRenewalR13_1(t *testing.T) {
	nb := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, life := range []time.Duration{time.Minute, 2 * time.Minute, 5 * time.Minute, time.Hour, 24 * time.Hour, 7 * 24 * time.Hour, 90 * 24 * time.Hour} {
		id := &identity.Identity{Chain: []*x509.Certificate{{NotBefore: nb, NotAfter: nb.Add(life)}}}
		share := func(d time.Duration) float64 { return float64(d) / float64(life) }
		var rnd float64
		r, err := renew.New(renew.Config{BCD: validConfig(), Store: &identity.Store{Dir: t.TempDir()}, Rand: func() float64 { return rnd }})
		if err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct{ rand, want float64 }{{0, 0.45}, {0.25, 0.525}, {0.5, 0.60}, {1, 0.75}} {
			rnd = tc.rand
			if got := share(r.NextRenewal(id).Sub(nb)); got < tc.want-1e-9 || got > tc.want+1e-9 {
				t.Errorf("life %s, rand %v: renews at %.4f of the lifetime, want %.4f", life, tc.rand, got, tc.want)
			}
		}
		const steps = 1000
		sum, prev := 0.0, 0.0
		for i := range steps {
			rnd = (float64(i) + 0.5) / steps
			got := share(r.NextRenewal(id).Sub(nb))
			if got < 0.45 || got >= 0.75 || got < prev {
				t.Fatalf("life %s, rand %v: renews at %.4f of the lifetime (after %.4f), want [0.45, 0.75), ordered", life, rnd, got, prev)
			}
			// At least a quarter of the lifetime left for the retries.
			if left := nb.Add(life).Sub(r.NextRenewal(id)); left < life/4 {
				t.Fatalf("life %s: %s left after the renewal is due, want at least %s", life, left, life/4)
			}
			sum, prev = sum+got, got
		}
		if mean := sum / steps; mean < 0.599 || mean > 0.601 {
			t.Errorf("life %s: mean due at %.4f of the lifetime, want 0.60", life, mean)
		}
	}
}

func TestBackoff(t *testing.T) {
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 5: 16 * time.Second, 9: 256 * time.Second, 10: 5 * time.Minute, 50: 5 * time.Minute} {
		if got := renew.Backoff(n); got != want {
			t.Errorf("Backoff(%d) = %s, want %s", n, got, want)
		}
	}
}

func validConfig() *bcdconfig.Config {
	b, err := ca.Generate("compute.example.com", time.Now())
	if err != nil {
		panic(err)
	}
	pins, err := b.Pins()
	if err != nil {
		panic(err)
	}
	return &bcdconfig.Config{GatewayURL: "https://gw.example.com", Site: ids.New(ids.Site, time.Now()),
		ServingCASPKIPin: pins.ServingCA, JoinSigningKeyPin: pins.JoinSigning, JoinEncryptionKeyPin: pins.JoinEncryption}
}
