package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/checks/enrolltest"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// hostileGateway is a gateway of someone else's PKI that answers Keys with
// statements vouching for its own serving CA: one signed by its own key,
// one that names the daemon's pinned key as signer but is signed by its own.
type hostileGateway struct {
	agentv1connect.UnimplementedJoinServiceHandler
	statements []string
	keysCalls  atomic.Int64
}

func (h *hostileGateway) Keys(context.Context, *connect.Request[agentv1.KeysRequest]) (*connect.Response[agentv1.KeysResponse], error) {
	h.keysCalls.Add(1)
	return connect.NewResponse(&agentv1.KeysResponse{KeyStatements: h.statements}), nil
}

func startHostileGateway(t *testing.T, pinnedServingCA []byte) (*hostileGateway, string) {
	t.Helper()
	evil, err := ca.Generate("compute.example.com", time.Now())
	must(t, err)
	certPEM, keyPEM, err := ca.IssueGateway(evil, []string{"127.0.0.1"}, time.Now(), time.Hour)
	must(t, err)
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	must(t, err)
	own := enrolltest.Statement(t, pki.KindServingCA, pki.ActionTrust, evil.CommandSigningKey, evil.ServingCA.PublicKey)
	// A statement that claims the pinned CA as its signer: same body shape,
	// but the signature is the evil key's.
	subject, err := x509.MarshalPKIXPublicKey(evil.ServingCA.PublicKey)
	must(t, err)
	forged := forgeStatement(t, pinnedServingCA, subject, evil)
	h := &hostileGateway{statements: []string{own, forged}}
	path, handler := agentv1connect.NewJoinServiceHandler(h)
	mux := http.NewServeMux()
	mux.Handle(path, handler)
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // bcd hanging up on it is the point
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return h, srv.URL
}

// forgeStatement is a statement naming signerSPKI (a key the forger does
// not hold) as its signer, signed by evil's key.
func forgeStatement(t *testing.T, signerSPKI, subject []byte, evil *ca.Bundle) string {
	t.Helper()
	signer, err := x509.MarshalPKIXPublicKey(evil.JoinSigningKey.Public())
	must(t, err)
	real, err := pki.SignKeyStatement(evil.JoinSigningKey, pki.KeyStatement{Kind: pki.KindServingCA, Action: pki.ActionTrust,
		Signer: signer, Subject: subject, IssuedAt: time.Now()})
	must(t, err)
	_, sig, _ := strings.Cut(real, ".")
	body := fmt.Sprintf(`{"kind":%q,"action":"trust","signer":%q,"subject":%q,"issuedAt":%q}`,
		pki.KindServingCA, base64.StdEncoding.EncodeToString(signerSPKI), base64.StdEncoding.EncodeToString(subject), time.Now().UTC().Format(time.RFC3339))
	return base64.RawURLEncoding.EncodeToString([]byte(body)) + "." + sig
}

// R16.2, R21.1: a bcd stopped before the serving CA, both JoinService keys
// and the node CA rotated, and started after they were retired, comes back
// by itself (its certificate, of the retired node CA, still renews onto
// the new one): its
// pinned gateway chain no longer matches, it asks for the statements, follows
// the chain from the keys it pins, renews and holds its session. A gateway
// of another PKI that injects statements (one signed by its own key, one
// forged in the name of the pinned key) gets nowhere: the renewal is refused
// and config.toml is not touched.
func TestOfflineBCDFollowsRotation(t *testing.T) {
	if testing.Short() {
		t.Skip("serve, a gateway and a bcd through three rotations (about 30 s)")
	}
	p := startRotationPlane(t, 600)
	_, bcd := binaries(t)
	tok := p.cli("join-tokens", "create", "--tenant", p.tenant, "--pool", p.pool, "--ttl", "1h", "--max-uses", "1")["token"].(string)
	sb := newBCDIn(t, p.dir, "offline", p.gwURL, p.site, p.pins)
	sys, data := filepath.Join(p.dir, "sys-offline"), filepath.Join(p.dir, "data-offline")
	fakeSysfs(t, sys, "OFF-0001", "c1a57e00-0000-4000-8000-0000000000ff", "3c:ec:ef:00:30:01")
	out, errOut, code := run(t, nil, tok+"\n", bcd, "join", "--config", sb.Conf, "--data-dir", data, "--sysfs-root", sys)
	if code != 0 {
		t.Fatalf("bcd join: %s\n%s", out, errOut)
	}

	// The daemon is off; the three keys it pins and the node CA that issued
	// its certificate rotate all the way (R21.1: it comes back from all of
	// them together without a person).
	kinds := []string{"serving-ca", "join-signing", "join-encryption", "node-ca"}
	for _, phase := range []string{"prepare", "activate", "retire"} {
		for _, k := range kinds {
			if phase == "retire" {
				// R21.2: the daemon is behind, so retire needs --force;
				// the daemon follows the chain all the same.
				p.pki(t, "rotate", k, "--phase", phase, "--force")
				continue
			}
			p.pki(t, "rotate", k, "--phase", phase)
		}
		switch phase {
		case "prepare", "retire":
			p.pki(t, "ca-file", "--out", p.gwCA)
		case "activate":
			p.reissue(t)
		}
	}
	p.statements(t, 6)

	// A hostile gateway first: a copy of the config pointing at it.
	servingCA, err := os.ReadFile(filepath.Join(p.dir, "pki", "serving-ca.crt"))
	must(t, err)
	blk, _ := pem.Decode(servingCA)
	oldCA, err := x509.ParseCertificate(blk.Bytes)
	must(t, err)
	h, hostileURL := startHostileGateway(t, oldCA.RawSubjectPublicKeyInfo)
	conf, err := os.ReadFile(sb.Conf)
	must(t, err)
	hostileConf := filepath.Join(filepath.Dir(sb.Conf), "hostile.toml")
	hostile := bytes.Replace(conf, []byte(p.gwURL), []byte(hostileURL), 1)
	must(t, os.WriteFile(hostileConf, hostile, 0o600))
	out, errOut, code = run(t, nil, "", bcd, "renew", "--config", hostileConf, "--data-dir", data)
	if code == 0 {
		t.Fatalf("renewal through a gateway of another PKI succeeded:\n%s%s", out, errOut)
	}
	if h.keysCalls.Load() == 0 {
		t.Fatalf("bcd did not ask the hostile gateway for statements (so the injection was not tried):\n%s", errOut)
	}
	after, err := os.ReadFile(hostileConf)
	must(t, err)
	if !bytes.Equal(after, hostile) {
		t.Fatalf("injected statements changed config.toml:\n%s", after)
	}

	// The real gateway: bcd follows the chain and renews.
	out, errOut, code = run(t, nil, "", bcd, "renew", "--config", sb.Conf, "--data-dir", data)
	if code != 0 {
		t.Fatalf("bcd renew after the rotation: %s\n%s", out, errOut)
	}
	final := jsonOf(t, p.pki(t, "pins", "--json"))
	learned, err := os.ReadFile(sb.Conf)
	must(t, err)
	for _, key := range []string{"servingCaPins", "joinSigningKeyPins", "joinEncryptionKeyPins"} {
		pin := final[key].([]any)[0].(string)
		if !strings.Contains(string(learned), pin) {
			t.Fatalf("config.toml lacks the new %s %s:\n%s", key, pin, learned)
		}
	}
	cfg, err := bcdconfig.Load(sb.Conf)
	must(t, err)
	for _, pin := range []string{p.pins["servingCaPin"].(string), p.pins["joinSigningKeyPin"].(string), p.pins["joinEncryptionKeyPin"].(string)} {
		for _, kind := range bcdconfig.PinKinds() {
			if slices.Contains(cfg.PinSet(kind), pin) {
				t.Fatalf("config.toml still pins the retired %s:\n%s", pin, learned)
			}
		}
		// R21.3: and keeps it as retired, never to pin again.
		if !slices.Contains(cfg.RetiredPins, pin) {
			t.Fatalf("config.toml's retired_pins lacks %s:\n%s", pin, learned)
		}
	}
	start(t, nil, bcd, "run", "--config", sb.Conf, "--data-dir", data)
	waitFor(t, "the daemon's session after the rotation", 30*time.Second, func() bool { return p.connected(t) == 1 })
}
