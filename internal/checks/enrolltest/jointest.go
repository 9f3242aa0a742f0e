// Package enrolltest is a fake JoinService behind a real TLS gateway, for the
// tests of bcd's join and CLI. It is a fake, not a mock: it opens the seal
// with the bundle's encryption key, signs a real node certificate with the
// node CA, signs the body with the join-signing key, and serves the
// well-known document. Like JoinService, it keeps each answer by the
// request's digest and hands it back when the same request arrives again
// (R4.9). Hooks let a test tamper with the answer or lose it on the way back.
package enrolltest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/wire"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/secret"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// TrustDomain is the fake deployment's trust domain.
const TrustDomain = "compute.example.com"

// GatewayServerName is a DNS SAN of the gateway certificate besides
// 127.0.0.1, and the well-known document's gateway.serverName.
const GatewayServerName = "gw.test"

// Answer is what the fake is about to send; tamper hooks change it.
type Answer struct {
	Params ca.NodeCertParams
	// CSR is the request the certificate is signed for.
	CSR  []byte
	Body *agentv1.JoinResponseBody
	// Signer signs the body; SigningCert goes out as signing_certificate.
	Signer      crypto.Signer
	SigningCert []byte
}

// JoinService is the fake.
type JoinService struct {
	agentv1connect.UnimplementedJoinServiceHandler
	t      testing.TB
	bundle *ca.Bundle
	site   string
	token  string
	now    time.Time

	mu       sync.Mutex
	requests []*agentv1.JoinRequest
	fail     error
	before   func(a *Answer)
	after    func(a *Answer)
	// answers are the answers given, by request digest (R4.9).
	answers    map[string]*agentv1.JoinResponse
	admissions int
	losses     []Loss
	// deferrals is how many calls still get a signed deferral (R10.1);
	// then the join is refused when refuseAfter, else admitted. deferMod
	// alters each deferral's body before it is signed.
	deferrals   int
	refuseAfter bool
	deferMod    func(*agentv1.JoinResponseBody)
	// rotation is what the fake says of rotated keys (keys.go).
	rotation rotation
}

// DeferNext answers the next n calls with a signed deferral naming join
// request jreq_01k5w00000000000000000test (R10.1); after them the join is
// refused when refuse is set (a rejected request), else admitted. mod, when
// set, alters each deferral's body before it is signed (a forgery).
func (f *JoinService) DeferNext(n int, refuse bool, mod func(*agentv1.JoinResponseBody)) {
	f.mu.Lock()
	f.deferrals, f.refuseAfter, f.deferMod = n, refuse, mod
	f.mu.Unlock()
}

// DeferredRequest is the join request the fake's deferrals name.
const DeferredRequest = "jreq_01k5w00000000000000000test"

// Loss is how the gateway loses an answer the fake already gave and stored
// (R4.9): the join landed, the daemon does not learn it.
type Loss struct {
	// Status, when not zero, answers with this HTTP status instead (502,
	// 503, 504: a gateway whose upstream failed).
	Status int
	// Reset closes the daemon's connections instead of answering.
	Reset bool
	// Hang answers nothing until the daemon gives up (its deadline).
	Hang bool
}

// LoseAnswers makes the next len(l) Join calls run and store their answer,
// then lose it as l says, in order.
func (f *JoinService) LoseAnswers(l ...Loss) {
	f.mu.Lock()
	f.losses = append(f.losses, l...)
	f.mu.Unlock()
}

// Admissions returns how many joins the fake admitted: answers it made, not
// those it handed back again for a request it had answered.
func (f *JoinService) Admissions() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.admissions
}

// Requests returns every Join request that arrived, in order.
func (f *JoinService) Requests() []*agentv1.JoinRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*agentv1.JoinRequest(nil), f.requests...)
}

// Fail makes every Join answer err (an *errs.E) through wire.ToWire.
func (f *JoinService) Fail(err error) { f.mu.Lock(); f.fail = err; f.mu.Unlock() }

// BeforeSign sets a hook that changes the certificate's parameters or CSR.
func (f *JoinService) BeforeSign(h func(a *Answer)) { f.mu.Lock(); f.before = h; f.mu.Unlock() }

// AfterSign sets a hook that changes the body, the signer or the
// certificate sent.
func (f *JoinService) AfterSign(h func(a *Answer)) { f.mu.Lock(); f.after = h; f.mu.Unlock() }

// Calls returns how many Join requests arrived.
func (f *JoinService) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.requests)
}

// LastRequest returns the last Join request.
func (f *JoinService) LastRequest() *agentv1.JoinRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests[len(f.requests)-1]
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// Join implements JoinService.Join.
func (f *JoinService) Join(_ context.Context, req *connect.Request[agentv1.JoinRequest]) (*connect.Response[agentv1.JoinResponse], error) {
	f.mu.Lock()
	f.requests = append(f.requests, req.Msg)
	fail, before, after := f.fail, f.before, f.after
	f.mu.Unlock()
	refuse := func() error {
		return wire.ToWire(discard, "Join", errs.New(errs.AccessDenied, "Join refused"))
	}
	if fail != nil {
		return nil, wire.ToWire(discard, "Join", fail)
	}
	if req.Msg.GetAttestor() == "x509pop" {
		// R10.5: the evidence instead of a token: a leaf of this PKI whose
		// key signed the request's digest.
		if !x509PopOK(f.bundle, req.Msg) {
			return nil, refuse()
		}
	} else if tok, err := ca.Open(f.bundle.JoinEncryptionKey, req.Msg.GetSealedToken(), req.Msg.GetCsr(), pki.JoinRequestDigest(req.Msg), f.now); err != nil || tok != f.token {
		return nil, refuse()
	}
	f.mu.Lock()
	deferring, refuseNow, mod := f.deferrals > 0, f.deferrals == 0 && f.refuseAfter, f.deferMod
	if deferring {
		f.deferrals--
	}
	f.mu.Unlock()
	if refuseNow {
		return nil, refuse()
	}
	if deferring {
		role := req.Msg.GetRole()
		if role == "" {
			role = pki.RoleNode
		}
		b := &agentv1.JoinResponseBody{CsrSha256: pki.CSRHash(req.Msg.GetCsr()), TrustDomain: f.bundle.TrustDomain, SiteId: f.site, Role: role,
			Deferral: &agentv1.JoinDeferral{RequestId: DeferredRequest, RetryAfterSeconds: 7}}
		if mod != nil {
			mod(b)
		}
		raw, _ := proto.Marshal(b)
		sig, err := pki.SignResponse(f.bundle.JoinSigningKey, raw)
		if err != nil {
			f.t.Errorf("fake JoinService: %v", err)
			return nil, refuse()
		}
		return connect.NewResponse(&agentv1.JoinResponse{Body: raw, Sig: sig, SigningCertificate: f.bundle.JoinSigningCert.Raw}), nil
	}
	// R4.9: a request answered before gets that answer again.
	digest := string(pki.JoinRequestDigest(req.Msg))
	f.mu.Lock()
	stored := f.answers[digest]
	f.mu.Unlock()
	if stored != nil {
		return connect.NewResponse(proto.Clone(stored).(*agentv1.JoinResponse)), nil
	}
	role := req.Msg.GetRole()
	if role == "" {
		role = pki.RoleNode
	}
	nodeID := req.Msg.GetNodeId()
	if nodeID == "" {
		nodeID = ids.New(ids.Node, time.Now())
	}
	a := &Answer{
		Params: ca.NodeCertParams{
			TrustDomain: f.bundle.TrustDomain, SiteID: f.site, NodeID: nodeID, Role: role,
			NotBefore: f.now, NotAfter: f.now.Add(24 * time.Hour),
		},
		CSR:         req.Msg.GetCsr(),
		Signer:      f.bundle.JoinSigningKey,
		SigningCert: f.bundle.JoinSigningCert.Raw,
	}
	f.rotated(a)
	if before != nil {
		before(a)
	}
	nc, err := ca.SignNodeCert(f.bundle.NodeCA, f.bundle.NodeCAKey, a.CSR, a.Params)
	if err != nil {
		f.t.Errorf("fake JoinService: sign node cert: %v", err)
		return nil, refuse()
	}
	a.Body = &agentv1.JoinResponseBody{
		NodeId:        a.Params.NodeID,
		CertChain:     [][]byte{nc.DER, f.bundle.NodeCA.Raw},
		CommandBundle: [][]byte{f.bundle.CommandSigningCert.Raw},
		CsrSha256:     pki.CSRHash(req.Msg.GetCsr()),
		TrustDomain:   f.bundle.TrustDomain,
		SiteId:        f.site,
		Role:          a.Params.Role,
		KeyStatements: f.rotation.statements(),
	}
	if after != nil {
		after(a)
	}
	body, err := proto.Marshal(a.Body)
	if err != nil {
		f.t.Errorf("fake JoinService: %v", err)
		return nil, refuse()
	}
	sig, err := pki.SignResponse(a.Signer, body)
	if err != nil {
		f.t.Errorf("fake JoinService: %v", err)
		return nil, refuse()
	}
	res := &agentv1.JoinResponse{Body: body, Sig: sig, SigningCertificate: a.SigningCert}
	f.mu.Lock()
	if f.answers == nil {
		f.answers = map[string]*agentv1.JoinResponse{}
	}
	f.answers[digest] = res
	f.admissions++
	f.mu.Unlock()
	out := proto.Clone(res).(*agentv1.JoinResponse)
	out.KeyStatements = f.rotation.outer()
	return connect.NewResponse(out), nil
}

// nextLoss pops the next loss, if any.
func (f *JoinService) nextLoss() (Loss, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.losses) == 0 {
		return Loss{}, false
	}
	l := f.losses[0]
	f.losses = f.losses[1:]
	return l, true
}

// lossy wraps the Join handler: with a loss pending, the call runs to the
// end (the answer is stored) and its answer is then lost on the way back,
// as a gateway or a network loses it.
func (f *JoinService) lossy(h http.Handler, closeConns func()) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, ok := f.nextLoss()
		if !ok {
			h.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			return
		}
		inner := r.Clone(context.WithoutCancel(r.Context()))
		inner.Body = io.NopCloser(bytes.NewReader(body))
		h.ServeHTTP(&discardWriter{h: http.Header{}}, inner)
		switch {
		case l.Status != 0:
			w.WriteHeader(l.Status)
		case l.Reset:
			closeConns()
		case l.Hang:
			<-r.Context().Done()
		}
	})
}

// discardWriter takes a whole answer and keeps none of it.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

// Options configure New.
type Options struct {
	// GatewayBundle issues the gateway's certificate; nil: the server's own
	// bundle (so the pins match).
	GatewayBundle *ca.Bundle
}

// Server is a PKI, and a gateway serving the fake JoinService and the
// well-known document (at /api/compute/.well-known/better-compute) over TLS
// with HTTP/2.
type Server struct {
	Now    time.Time
	Bundle *ca.Bundle
	Pins   pki.Pins
	Site   string
	// Token is the one join token the fake admits.
	Token       string
	JoinService *JoinService
	// Sessions is the fake SessionService (bcd run).
	Sessions *Sessions
	// URL is the gateway's (and the control plane's) https URL.
	URL string
	// Roots trusts the gateway's serving CA.
	Roots *x509.CertPool

	mu  sync.Mutex
	doc wire.WellKnown
	// cert is the gateway's serving certificate (SetGatewayBundle).
	cert *tls.Certificate
}

// New starts a Server, closed when the test ends. Its bundle is valid from
// an hour ago; node certificates start at Now.
func New(t testing.TB, o Options) *Server {
	t.Helper()
	now := time.Now().UTC().Truncate(time.Second)
	b, err := ca.Generate(TrustDomain, now.Add(-time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	pins, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{Now: now, Bundle: b, Pins: pins, Site: ids.New(ids.Site, now), Token: NewToken(now)}
	s.JoinService = &JoinService{t: t, bundle: b, site: s.Site, token: s.Token, now: now}

	gb := b
	if o.GatewayBundle != nil {
		gb = o.GatewayBundle
	}
	// Valid from an hour ago, like the bundle, so a daemon whose clock is
	// somewhat behind still reaches the JoinService.
	certPEM, keyPEM, err := ca.IssueGateway(gb, []string{GatewayServerName, "127.0.0.1"}, now.Add(-time.Hour), 25*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	s.Roots = x509.NewCertPool()
	s.Roots.AddCert(gb.ServingCA)

	mux := http.NewServeMux()
	var srv *httptest.Server
	joinPath, joinHandler := agentv1connect.NewJoinServiceHandler(s.JoinService)
	mux.Handle(joinPath, s.JoinService.lossy(joinHandler, func() { srv.CloseClientConnections() }))
	s.Sessions = &Sessions{rotation: &s.JoinService.rotation}
	sessionPath, sessionHandler := agentv1connect.NewSessionServiceHandler(s.Sessions)
	mux.Handle(sessionPath, withPeer(sessionHandler))
	mux.HandleFunc("GET /api/compute/.well-known/better-compute", func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		doc := s.doc
		s.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(doc)
	})
	srv = httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	// The refused handshakes of the pin tests are expected.
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	s.cert = &pair
	// The certificate of each handshake is the current one
	// (SetGatewayBundle); GetCertificate would not do, as a client dialing
	// an IP address sends no server name and gets Certificates[0].
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		// A node's session presents its certificate (Welcome names its node).
		return &tls.Config{Certificates: []tls.Certificate{*s.cert}, NextProtos: []string{"h2", "http/1.1"}, ClientAuth: tls.RequestClientCert}, nil
	}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	s.URL = srv.URL

	wkj, err := b.WellKnownJoin()
	if err != nil {
		t.Fatal(err)
	}
	s.doc = wire.WellKnown{
		Name: "better-compute", Version: version.Version, BasePath: "/api/compute",
		Protocol: wire.WellKnownProtocol{Min: version.ProtocolMin, Max: version.ProtocolMax},
		Join:     &wkj,
		Gateway:  &wire.WellKnownGateway{URL: s.URL, ServerName: GatewayServerName, ServingCAPin: pins.ServingCA},
	}
	return s
}

// SetDoc changes the served well-known document; change gets copies of the
// join and gateway sections.
func (s *Server) SetDoc(change func(d *wire.WellKnown)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	j, g := *s.doc.Join, *s.doc.Gateway
	s.doc.Join, s.doc.Gateway = &j, &g
	change(&s.doc)
}

// HTTPClient is an HTTPClientFunc for bcd's join: the given TLS config (the
// pinned one) for the gateway; for the well-known fetch (nil), a client
// that trusts the gateway's CA as a public server would be trusted.
func (s *Server) HTTPClient(c *tls.Config) *http.Client {
	if c == nil {
		c = &tls.Config{RootCAs: s.Roots}
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: c, ForceAttemptHTTP2: true}}
}

// Config returns a bcd config for this server under root: the data
// directory root/var/lib/bcd, a fake sysfs at root/sys, TPM off.
func (s *Server) Config(t testing.TB, root string) *bcdconfig.Config {
	t.Helper()
	return &bcdconfig.Config{
		GatewayURL:           s.URL,
		Site:                 s.Site,
		ServingCASPKIPin:     s.Pins.ServingCA,
		JoinSigningKeyPin:    s.Pins.JoinSigning,
		JoinEncryptionKeyPin: s.Pins.JoinEncryption,
		DataDir:              filepath.Join(root, "var", "lib", "bcd"),
		SysfsRoot:            FakeSysfs(t, filepath.Join(root, "sys")),
		ProcfsRoot:           filepath.Join(root, "proc"),
		TPM:                  bcdconfig.TPM{Mode: bcdconfig.TPMOff},
	}
}

// WriteKeyFile writes the server's join-encryption.jwk into dir.
func (s *Server) WriteKeyFile(t testing.TB, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := bcdconfig.WriteEncryptionKey(dir, s.Pins.JoinEncryption, &s.Bundle.JoinEncryptionKey.PublicKey); err != nil {
		t.Fatal(err)
	}
}

// Product identifiers of FakeSysfs.
const (
	ProductUUID   = "4C4C4544-0042-3510-8051-B7C04F4E3232"
	ProductSerial = "SN-7701"
	MAC           = "3c:ec:ef:01:02:03"
)

// FakeSysfs writes a machine with a product UUID, serials and one physical
// NIC under root and returns root.
func FakeSysfs(t testing.TB, root string) string {
	t.Helper()
	files := map[string]string{
		"class/dmi/id/product_uuid":       ProductUUID + "\n",
		"class/dmi/id/product_serial":     ProductSerial + "\n",
		"class/dmi/id/board_serial":       "BRD-1\n",
		"class/dmi/id/chassis_serial":     "CH-42\n",
		"class/net/eno1/address":          MAC + "\n",
		"class/net/eno1/addr_assign_type": "0\n",
	}
	for p, c := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("../../../devices/pci0000:00/0000:00:1f.6", filepath.Join(root, "class/net/eno1/device")); err != nil {
		t.Fatal(err)
	}
	return root
}

// NewToken returns a well-formed join token the fake does not know.
func NewToken(now time.Time) string {
	plain, _ := secret.Mint()
	return secret.Format("bcjt", ids.New(ids.JoinToken, now), plain)
}

// x509PopOK is the fake's x509pop check: no token, a leaf signed by the node
// CA, naming the requested node, whose key signed the request's digest.
func x509PopOK(b *ca.Bundle, req *agentv1.JoinRequest) bool {
	ev := req.GetX509Pop()
	if req.GetSealedToken() != "" || ev == nil || len(ev.GetChain()) == 0 {
		return false
	}
	leaf, err := x509.ParseCertificate(ev.GetChain()[0])
	if err != nil || leaf.CheckSignatureFrom(b.NodeCA) != nil {
		return false
	}
	id, err := pki.NodeIdentityOf(leaf)
	if err != nil || id.NodeID != req.GetNodeId() {
		return false
	}
	return pki.VerifyX509Pop(leaf.PublicKey, pki.JoinRequestDigest(req), ev.GetSig()) == nil
}
