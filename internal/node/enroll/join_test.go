package enroll

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// wantErr fails unless err carries code and every substring.
func wantErr(t *testing.T, req string, err error, code errs.Code, subs ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: no error, want %s %q", req, code, subs)
	}
	if got := errs.CodeOf(err); got != code {
		t.Fatalf("%s: code %s, want %s (%v)", req, got, code, err)
	}
	for _, s := range subs {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("%s: error %q lacks %q", req, err, s)
		}
	}
}

// nothingSaved fails when any identity file exists.
func nothingSaved(t *testing.T, req string, s *identity.Store) {
	t.Helper()
	present, err := s.Present()
	if err != nil {
		t.Fatal(err)
	}
	if len(present) != 0 {
		t.Fatalf("%s: identity files were saved: %v", req, present)
	}
}

// R4.1, R4.2, R4.3, R4.6: the join saves a checked identity.
func TestJoinHappyPath(t *testing.T) {
	e := newEnv(t, envOption{})
	id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
	if err != nil {
		t.Fatal(err)
	}
	if !ids.Valid(ids.Node, id.NodeID) || id.SiteID != e.site || id.TrustDomain != "compute.example.com" ||
		id.Role != pki.RoleNode || id.Attestor != identity.AttestorJoinToken || id.KeyKind != identity.KindSoftware ||
		id.SPIFFEID != pki.SPIFFEID("compute.example.com", e.site, id.NodeID) || id.Expired(e.now) {
		t.Fatalf("R4.6: identity %+v", id)
	}
	if !id.NotAfter.Equal(e.now.Add(24 * time.Hour)) {
		t.Errorf("not after %s", id.NotAfter)
	}
	// R4.1: node.key is 0600, and the identity loads back.
	st, err := os.Stat(filepath.Join(e.cfg.DataDir, identity.KeyFile))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("R4.1: node.key: %v %v", st.Mode(), err)
	}
	loaded, err := e.store.Load()
	if err != nil || loaded.NodeID != id.NodeID || len(loaded.Bundle) != 1 ||
		!loaded.Bundle[0].Equal(e.bundle.CommandSigningCert) {
		t.Fatalf("load: %v", err)
	}
	// R4.3: what was sent.
	req := e.fake.LastRequest()
	if req.GetAttestor() != "" || req.GetRole() != pki.RoleNode || req.GetProtocol() != version.ProtocolMax ||
		req.GetNodeId() != "" {
		t.Errorf("R4.3: request %v", req)
	}
	c := req.GetClaims()
	if c.GetProductUuid() != enrolltest.ProductUUID || c.GetProductSerial() != enrolltest.ProductSerial ||
		c.GetBoardSerial() != "BRD-1" || c.GetChassisSerial() != "CH-42" ||
		len(c.GetMacs()) != 1 || c.GetMacs()[0] != enrolltest.MAC || c.GetHostname() == "" {
		t.Errorf("R4.3: claims %v", c)
	}
	// R4.2: the token travels sealed to the CSR only.
	if strings.Contains(req.GetSealedToken(), e.token) {
		t.Error("R4.2: the token is readable in the request")
	}
	if _, err := ca.Open(e.bundle.JoinEncryptionKey, req.GetSealedToken(), req.GetCsr(), pki.JoinRequestDigest(req), e.now); err != nil {
		t.Errorf("R4.2: the seal does not open for the request it came with: %v", err)
	}
	if _, err := ca.Open(e.bundle.JoinEncryptionKey, req.GetSealedToken(), []byte("another csr"), pki.JoinRequestDigest(req), e.now); err == nil {
		t.Error("R4.2: the seal opens for another CSR")
	}
	// The seal covers the whole request: the claims the gateway relays too.
	changed := proto.Clone(req).(*agentv1.JoinRequest)
	changed.Claims.Hostname = "relay-was-here"
	if _, err := ca.Open(e.bundle.JoinEncryptionKey, req.GetSealedToken(), req.GetCsr(), pki.JoinRequestDigest(changed), e.now); err == nil {
		t.Error("R4.2: the seal opens for a request with other claims")
	}
	want := []string{"collecting hardware claims…", "sealing the token…", "joining through " + strings.TrimPrefix(e.srv.URL, "https://") + "…"}
	if strings.Join(e.progress, "|") != strings.Join(want, "|") {
		t.Errorf("progress %q, want %q", e.progress, want)
	}
}

// R11.4: a joined host answers already joined; --reset --yes moves the
// identity aside and the next join starts anew.
func TestAlreadyJoinedAndReset(t *testing.T) {
	e := newEnv(t, envOption{})
	j := e.joiner(e.cfg)
	first, err := j.Join(context.Background(), e.opts())
	if err != nil {
		t.Fatal(err)
	}
	_, err = j.Join(context.Background(), e.opts())
	wantErr(t, "R11.4", err, errs.InvalidState, "already joined as "+first.NodeID, "(SPIFFE ID "+first.SPIFFEID+")", "bcd join --reset --yes")
	if e.fake.Calls() != 1 {
		t.Fatalf("R11.4: the second join reached the gateway")
	}
	// An expired identity is still "already joined" and says so.
	e.clock.Advance(25 * time.Hour)
	_, err = j.Join(context.Background(), e.opts())
	wantErr(t, "R11.4", err, errs.InvalidState, "already joined", "expired at")
	e.clock.Set(e.now)

	aside, err := j.Reset(e.now)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(aside, identity.KeyFile)); err != nil {
		t.Fatalf("R11.4: the old key is not kept aside: %v", err)
	}
	nothingSaved(t, "R11.4", e.store)
	second, err := j.Join(context.Background(), e.opts())
	if err != nil {
		t.Fatal(err)
	}
	if second.Serial == first.Serial || second.Leaf().PublicKey.(*ecdsa.PublicKey).Equal(first.Leaf().PublicKey) {
		t.Fatal("R11.4: the new join reused the old certificate or key")
	}
	if _, err := j.Reset(e.now); err != nil {
		t.Fatal(err)
	}
	if _, err := j.Reset(e.now); !errors.Is(err, identity.ErrNotJoined) {
		t.Fatalf("reset without identity: %v", err)
	}
}

// R4.6: each check refuses a bad answer, in order, and nothing is saved.
func TestJoinResponseChecks(t *testing.T) {
	other, err := ca.Generate("compute.example.com", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		opts       func(o *Options)
		beforeSign func(e *env, a *enrolltest.Answer)
		afterSign  func(e *env, a *enrolltest.Answer)
		check      Check
		want       string
	}{
		{
			name: "signed by another key, with its certificate",
			afterSign: func(e *env, a *enrolltest.Answer) {
				a.Signer, a.SigningCert = other.JoinSigningKey, other.JoinSigningCert.Raw
			},
			check: CheckSignature, want: "does not match join_signing_key_pin",
		},
		{
			name:      "signed by another key, with the pinned certificate",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Signer = other.JoinSigningKey },
			check:     CheckSignature, want: "does not verify under the pinned join-signing key",
		},
		{
			name:      "no signing certificate",
			afterSign: func(e *env, a *enrolltest.Answer) { a.SigningCert = nil },
			check:     CheckSignature, want: "carries no signing certificate",
		},
		{
			name:      "another csr_sha256",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.CsrSha256 = pki.CSRHash([]byte("x")) },
			check:     CheckCSR, want: "another certificate request",
		},
		{
			name: "a leaf for another key",
			beforeSign: func(e *env, a *enrolltest.Answer) {
				csr, err := identity.NewCSR(newKey(e.t), "")
				if err != nil {
					e.t.Fatal(err)
				}
				a.CSR = csr
			},
			check: CheckLeafKey, want: "for another key",
		},
		{
			name:      "no certificate",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.CertChain = nil },
			check:     CheckLeafKey, want: "carries no certificate",
		},
		{
			name: "another site",
			beforeSign: func(e *env, a *enrolltest.Answer) {
				a.Params.SiteID = ids.New(ids.Site, e.now.Add(time.Second))
			},
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.SiteId = a.Params.SiteID },
			check:     CheckSPIFFEID, want: "not in this machine's site",
		},
		{
			name:       "a leaf for another site",
			beforeSign: func(e *env, a *enrolltest.Answer) { a.Params.SiteID = ids.New(ids.Site, e.now.Add(time.Second)) },
			check:      CheckSPIFFEID, want: "the certificate names site",
		},
		{
			name:       "another trust domain",
			beforeSign: func(e *env, a *enrolltest.Answer) { a.Params.TrustDomain = "evil.example.com" },
			check:      CheckSPIFFEID, want: "trust domain evil.example.com",
		},
		{
			name:      "another node in the body",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.NodeId = ids.New(ids.Node, e.now.Add(time.Second)) },
			check:     CheckSPIFFEID, want: "the certificate names node",
		},
		{
			name: "not the --node-id node",
			opts: func(o *Options) { o.NodeID = ids.New(ids.Node, time.Unix(1_700_000_000, 0)) },
			beforeSign: func(e *env, a *enrolltest.Answer) {
				a.Params.NodeID = ids.New(ids.Node, e.now.Add(time.Second))
			},
			check: CheckSPIFFEID, want: "not the node",
		},
		{
			name:       "another role",
			beforeSign: func(e *env, a *enrolltest.Answer) { a.Params.Role = pki.RoleSite },
			check:      CheckRole, want: `grants role "site", not the requested "node"`,
		},
		{
			name:      "a leaf with another role than the body",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.Role = pki.RoleNodeTenant },
			check:     CheckRole, want: "the certificate's role node",
		},
		{
			name:      "no command bundle",
			afterSign: func(e *env, a *enrolltest.Answer) { a.Body.CommandBundle = nil },
			check:     CheckBundle, want: "no command-signing certificate",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			if tt.beforeSign != nil {
				e.fake.BeforeSign(func(a *enrolltest.Answer) { tt.beforeSign(e, a) })
			}
			if tt.afterSign != nil {
				e.fake.AfterSign(func(a *enrolltest.Answer) { tt.afterSign(e, a) })
			}
			o := e.opts()
			if tt.opts != nil {
				tt.opts(&o)
			}
			_, err := e.joiner(e.cfg).Join(context.Background(), o)
			wantErr(t, "R4.6", err, errs.Unauthenticated, tt.want, "nothing was saved")
			var re *ResponseError
			if !errors.As(err, &re) || re.Check != tt.check {
				t.Fatalf("R4.6: failed check %v, want %s", re, tt.check)
			}
			if e.fake.Calls() != 1 {
				t.Fatalf("calls %d", e.fake.Calls())
			}
			nothingSaved(t, "R4.6", e.store)
		})
	}
}

// R4.6: a hosted token lowers node to node-tenant, which bcd accepts;
// --node-id lands on the named node.
func TestJoinAcceptedVariants(t *testing.T) {
	t.Run("node-tenant for a requested node", func(t *testing.T) {
		e := newEnv(t, envOption{})
		e.fake.BeforeSign(func(a *enrolltest.Answer) { a.Params.Role = pki.RoleNodeTenant })
		id, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
		if err != nil || id.Role != pki.RoleNodeTenant {
			t.Fatalf("R4.6: %v %+v", err, id)
		}
	})
	t.Run("node-tenant is never accepted for site", func(t *testing.T) {
		e := newEnv(t, envOption{})
		e.fake.BeforeSign(func(a *enrolltest.Answer) { a.Params.Role = pki.RoleNodeTenant })
		o := e.opts()
		o.Role = pki.RoleSite
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R4.6", err, errs.Unauthenticated, "role")
	})
	t.Run("--node-id", func(t *testing.T) {
		e := newEnv(t, envOption{})
		o := e.opts()
		o.NodeID = ids.New(ids.Node, e.now)
		id, err := e.joiner(e.cfg).Join(context.Background(), o)
		if err != nil || id.NodeID != o.NodeID || e.fake.LastRequest().GetNodeId() != o.NodeID {
			t.Fatalf("R11.3: %v", err)
		}
	})
	t.Run("signing certificate from the well-known document", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		e.fake.AfterSign(func(a *enrolltest.Answer) { a.SigningCert = nil })
		o := e.opts()
		o.Server = e.srv.URL
		if _, err := e.joiner(e.cfg).Join(context.Background(), o); err != nil {
			t.Fatalf("R4.6: %v", err)
		}
	})
}

// R4.3: the gateway is authenticated by the serving CA pin before the
// token leaves the machine.
func TestGatewayPin(t *testing.T) {
	other, err := ca.Generate("compute.example.com", time.Now().Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	t.Run("another CA", func(t *testing.T) {
		e := newEnv(t, envOption{gatewayBundle: other})
		_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
		wantErr(t, "R4.3", err, errs.Unauthenticated, "serving_ca_spki_pin", "the token was not sent")
		if e.fake.Calls() != 0 {
			t.Fatal("R4.3: the fake saw a request")
		}
		nothingSaved(t, "R4.3", e.store)
	})
	t.Run("another server name", func(t *testing.T) {
		e := newEnv(t, envOption{})
		cfg := *e.cfg
		cfg.GatewayServerName = "gw.other.test"
		_, err := e.joiner(&cfg).Join(context.Background(), e.opts())
		wantErr(t, "R4.3", err, errs.Unauthenticated, "does not verify against the pinned serving CA", "the token was not sent")
		if e.fake.Calls() != 0 {
			t.Fatal("R4.3: the fake saw a request")
		}
	})
	t.Run("gateway_server_name", func(t *testing.T) {
		e := newEnv(t, envOption{})
		cfg := *e.cfg
		cfg.GatewayServerName = enrolltest.GatewayServerName
		if _, err := e.joiner(&cfg).Join(context.Background(), e.opts()); err != nil {
			t.Fatalf("R4.3: %v", err)
		}
	})
}

// R4.7, R4.8: server errors arrive as product codes.
func TestServerErrors(t *testing.T) {
	tests := []struct {
		name string
		fail error
		// badToken sends a token the fake does not know.
		badToken bool
		code     errs.Code
		want     string
	}{
		{name: "refused", badToken: true, code: errs.AccessDenied, want: "Join refused"},
		{name: "not configured", fail: errs.New(errs.InvalidConfig, "JoinService is not configured"), code: errs.InvalidConfig, want: "JoinService is not configured"},
		{name: "concurrent", fail: errs.New(errs.Conflict, "This machine joined concurrently; retry"), code: errs.Conflict, want: "This machine joined concurrently; retry"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			if tt.fail != nil {
				e.fake.Fail(tt.fail)
			}
			o := e.opts()
			if tt.badToken {
				o.Token = newToken(e.now)
			}
			_, err := e.joiner(e.cfg).Join(context.Background(), o)
			wantErr(t, "R4.7", err, tt.code, tt.want)
			nothingSaved(t, "R4.7", e.store)
		})
	}
}

// R11.1: the encryption key file, and the well-known fallback with --server.
func TestEncryptionKey(t *testing.T) {
	t.Run("file not matching the pin", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		data, _ := pki.MarshalEncryptionJWK(&newKey(t).PublicKey)
		if err := os.MkdirAll(filepath.Dir(e.cfgPath), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(filepath.Dir(e.cfgPath), bcdconfig.EncryptionKeyFile), data, 0o644); err != nil {
			t.Fatal(err)
		}
		o := e.opts()
		o.Server = e.srv.URL // a present file never falls back
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R11.1", err, errs.InvalidConfig, "does not match join_encryption_key_pin")
		if e.fake.Calls() != 0 {
			t.Fatal("R11.1: joined with a key that does not match")
		}
	})
	t.Run("no file, no --server", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
		wantErr(t, "R11.1", err, errs.InvalidConfig, "join-encryption.jwk is missing", "--server")
	})
	t.Run("well-known key matching the pin", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		o := e.opts()
		o.Server = e.srv.URL
		if _, err := e.joiner(e.cfg).Join(context.Background(), o); err != nil {
			t.Fatalf("R11.1: %v", err)
		}
		// Only a host build writes the key.
		if _, err := os.Stat(filepath.Join(filepath.Dir(e.cfgPath), bcdconfig.EncryptionKeyFile)); err == nil {
			t.Error("R11.1: the fetched key was written")
		}
	})
	t.Run("well-known key not matching the pin", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		jwk, _ := pki.MarshalEncryptionJWK(&newKey(t).PublicKey)
		e.setDoc(func(d *wire.WellKnown) { d.Join.EncryptionJWK = jwk })
		o := e.opts()
		o.Server = e.srv.URL
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R11.1", err, errs.InvalidConfig, "does not match join_encryption_key_pin")
		if e.fake.Calls() != 0 {
			t.Fatal("R11.1: joined with an unpinned key")
		}
	})
	t.Run("server with a base path", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		o := e.opts()
		o.Server = e.srv.URL + "/api/compute/"
		if _, err := e.joiner(e.cfg).Join(context.Background(), o); err != nil {
			t.Fatalf("R11.1: %v", err)
		}
	})
	t.Run("server with a wrong base path", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		o := e.opts()
		o.Server = e.srv.URL + "/compute"
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R11.1", err, errs.Unavailable, "404")
	})
}

// R11.3: a host without config.toml builds it from the well-known document
// with the pins from the flags.
func TestHostBuild(t *testing.T) {
	bootstrap := func(e *env) *Bootstrap {
		return &Bootstrap{
			Site: e.site, ServingCAPin: e.pins.ServingCA, JoinSigningPin: e.pins.JoinSigning, JoinEncryptionPin: e.pins.JoinEncryption,
			DataDir: e.cfg.DataDir, SysfsRoot: e.cfg.SysfsRoot, ProcfsRoot: e.cfg.ProcfsRoot,
		}
	}
	t.Run("builds and writes config.toml and join-encryption.jwk", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		o := e.opts()
		o.Server, o.Bootstrap = e.srv.URL, bootstrap(e)
		id, err := e.joiner(nil).Join(context.Background(), o)
		if err != nil {
			t.Fatalf("R11.3: %v", err)
		}
		got, err := bcdconfig.Load(e.cfgPath)
		if err != nil {
			t.Fatalf("R11.3: config.toml: %v", err)
		}
		if got.GatewayURL != e.srv.URL || got.GatewayServerName != enrolltest.GatewayServerName || got.Site != e.site ||
			got.ServingCASPKIPin != e.pins.ServingCA || got.JoinSigningKeyPin != e.pins.JoinSigning ||
			got.JoinEncryptionKeyPin != e.pins.JoinEncryption || got.DataDir != e.cfg.DataDir {
			t.Fatalf("R11.3: config %+v", got)
		}
		key, found, err := bcdconfig.LoadEncryptionKey(filepath.Dir(e.cfgPath), e.pins.JoinEncryption)
		if err != nil || !found || !key.Equal(&e.bundle.JoinEncryptionKey.PublicKey) {
			t.Fatalf("R11.3: join-encryption.jwk: %v %v", found, err)
		}
		if id.SiteID != e.site {
			t.Fatal(id)
		}
	})
	docTests := []struct {
		name   string
		change func(e *env, d *wire.WellKnown)
		want   string
	}{
		{name: "serving CA pin differs", change: func(e *env, d *wire.WellKnown) { d.Gateway.ServingCAPin = e.pins.JoinSigning }, want: "gateway.servingCaPin differs from --serving-ca-pin"},
		{name: "signing pin differs", change: func(e *env, d *wire.WellKnown) { d.Join.SigningKeyPin = e.pins.ServingCA }, want: "join.signingKeyPin differs"},
		{name: "encryption pin differs", change: func(e *env, d *wire.WellKnown) { d.Join.EncryptionKeyPin = e.pins.ServingCA }, want: "join.encryptionKeyPin differs"},
		{name: "no gateway section", change: func(e *env, d *wire.WellKnown) { d.Gateway = nil }, want: "no gateway section"},
		{name: "no join section", change: func(e *env, d *wire.WellKnown) { d.Join = nil }, want: "no join section"},
	}
	for _, tt := range docTests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{noKeyFile: true})
			e.setDoc(func(d *wire.WellKnown) { tt.change(e, d) })
			o := e.opts()
			o.Server, o.Bootstrap = e.srv.URL, bootstrap(e)
			_, err := e.joiner(nil).Join(context.Background(), o)
			wantErr(t, "R11.3", err, errs.InvalidConfig, tt.want)
			if e.fake.Calls() != 0 {
				t.Fatal("R11.3: joined")
			}
			if _, err := os.Stat(e.cfgPath); err == nil {
				t.Fatal("R11.3: config.toml written")
			}
		})
	}
	t.Run("a gateway outside the pins", func(t *testing.T) {
		// The document names a gateway (its pins say ours) whose
		// certificate is from another PKI: the pinned TLS refuses it.
		other, err := ca.Generate("compute.example.com", time.Now().Add(-time.Hour))
		if err != nil {
			t.Fatal(err)
		}
		evil := newEnv(t, envOption{gatewayBundle: other})
		e := newEnv(t, envOption{noKeyFile: true})
		e.setDoc(func(d *wire.WellKnown) { d.Gateway.URL = evil.srv.URL })
		o := e.opts()
		o.Server, o.Bootstrap = e.srv.URL, bootstrap(e)
		_, err = e.joiner(nil).Join(context.Background(), o)
		wantErr(t, "R11.3", err, errs.Unauthenticated, "the token was not sent")
		if evil.fake.Calls() != 0 {
			t.Fatal("R11.3: the unpinned gateway saw the token")
		}
	})
	t.Run("flags missing", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		o := e.opts()
		o.Server, o.Bootstrap = e.srv.URL, bootstrap(e)
		o.Bootstrap.Site = ""
		_, err := e.joiner(nil).Join(context.Background(), o)
		wantErr(t, "R11.3", err, errs.InvalidArgument, "--site")
	})
	t.Run("no config and no --server", func(t *testing.T) {
		e := newEnv(t, envOption{noKeyFile: true})
		_, err := e.joiner(nil).Join(context.Background(), e.opts())
		wantErr(t, "R11.3", err, errs.InvalidConfig, "no bcd config at", "--server")
	})
	t.Run("bootstrap flags with a config", func(t *testing.T) {
		e := newEnv(t, envOption{})
		o := e.opts()
		o.Server, o.Bootstrap = e.srv.URL, bootstrap(e)
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R11.3", err, errs.InvalidArgument, "exists")
	})
}

func TestCheckOptions(t *testing.T) {
	e := newEnv(t, envOption{})
	tests := []struct {
		name string
		o    Options
		want string
	}{
		{name: "no token", o: Options{}, want: "no join token"},
		{name: "bad role", o: Options{Token: e.token, Role: "admin"}, want: "want node, site"},
		{name: "other attestor", o: Options{Token: e.token, Attestor: "sgx"}, want: "joins with a join token (attestor join-token"},
		{name: "R9.2 tpm with a token", o: Options{Token: e.token, Attestor: "tpm"}, want: "--attestor tpm takes no join token"},
		{name: "x509pop with a token", o: Options{Token: e.token, Attestor: "x509pop"}, want: "takes no join token"},
		{name: "x509pop bad node id", o: Options{Attestor: "x509pop", NodeID: "pool_x"}, want: "--node-id"},
		{name: "bad node id", o: Options{Token: e.token, NodeID: "pool_x"}, want: "--node-id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := e.joiner(e.cfg).Join(context.Background(), tt.o)
			wantErr(t, "R4.3", err, errs.InvalidArgument, tt.want)
		})
	}
}

// R11.1: --server names the control plane; the base path defaults.
func TestWellKnownURL(t *testing.T) {
	tests := []struct{ in, want, err string }{
		{in: "https://compute.example.com", want: "https://compute.example.com/api/compute/.well-known/better-compute"},
		{in: "https://compute.example.com/", want: "https://compute.example.com/api/compute/.well-known/better-compute"},
		{in: "https://compute.example.com:8443/bc/", want: "https://compute.example.com:8443/bc/.well-known/better-compute"},
		{in: "http://127.0.0.1:8080", want: "http://127.0.0.1:8080/api/compute/.well-known/better-compute"},
		{in: "ftp://x", err: "want the control plane's URL"},
		{in: "https://u:p@x", err: "credentials"},
		{in: "https://x/?a=b", err: "query"},
		{in: "compute.example.com", err: "want the control plane's URL"},
	}
	for _, tt := range tests {
		got, err := WellKnownURL(tt.in)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("R11.1: %s: %v, want %q", tt.in, err, tt.err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("R11.1: %s: %q %v, want %q", tt.in, got, err, tt.want)
		}
	}
}

// R4.6: verifyResponse checks the signature before it parses anything.
func TestVerifySignatureFirst(t *testing.T) {
	e := newEnv(t, envOption{})
	cert := e.bundle.JoinSigningCert
	// A body that is garbage but "signed" wrongly must fail the
	// signature check, not the parse.
	res := &agentv1.JoinResponse{Body: []byte("not a protobuf"), Sig: []byte("x"), SigningCertificate: cert.Raw}
	_, err := verifyResponse(res, expectation{signingPins: []string{e.pins.JoinSigning}})
	var re *ResponseError
	if !errors.As(err, &re) || re.Check != CheckSignature {
		t.Fatalf("R4.6: %v", err)
	}
	// A pinned document certificate stands in for a missing one.
	sig, _ := pki.SignResponse(e.bundle.JoinSigningKey, []byte("not a protobuf"))
	res = &agentv1.JoinResponse{Body: []byte("not a protobuf"), Sig: sig}
	_, err = verifyResponse(res, expectation{signingPins: []string{e.pins.JoinSigning}, docCert: cert})
	if !errors.As(err, &re) || re.Check != CheckCSR {
		t.Fatalf("R4.6: %v", err)
	}
}

// R4.2: a machine whose clock is off is refused (its seal is dated outside
// the control plane's window); the refusal says so when the gateway's Date
// shows it, and says nothing of clocks otherwise.
func TestRefusalNamesClockSkewR4_2(t *testing.T) {
	tests := []struct {
		name  string
		shift time.Duration
		want  string
	}{
		{name: "ahead", shift: 20 * time.Minute, want: "ahead of the gateway's, and a seal dated more than 5m0s ahead of the control plane's clock is refused: set the clock (NTP) and join again"},
		{name: "behind", shift: -20 * time.Minute, want: "behind the gateway's, and a seal older than 10m0s by the control plane's clock is refused: set the clock (NTP) and join again"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t, envOption{})
			e.clock.Advance(tt.shift)
			_, err := e.joiner(e.cfg).Join(context.Background(), e.opts())
			wantErr(t, "R4.2", err, errs.AccessDenied, "Join refused", "this machine's clock is ", tt.want)
			nothingSaved(t, "R4.2", e.store)
		})
	}
	t.Run("a refusal with the clock right", func(t *testing.T) {
		e := newEnv(t, envOption{})
		o := e.opts()
		o.Token = newToken(e.now)
		_, err := e.joiner(e.cfg).Join(context.Background(), o)
		wantErr(t, "R4.7", err, errs.AccessDenied, "Join refused")
		if strings.Contains(err.Error(), "clock") {
			t.Errorf("R4.7: %v", err)
		}
	})
}
