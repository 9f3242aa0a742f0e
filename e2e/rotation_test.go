package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// pinnedKinds are the kinds a daemon pins, as bcd's config names them.
var pinnedKinds = []string{pki.KindServingCA, pki.KindJoinSigning, pki.KindJoinEncryption}

// fleetMachine is a simulated machine that keeps its pins as bcd does:
// sets, changed only by statements a pinned key signed (R16.2).
type fleetMachine struct {
	i       int
	claims  *agentv1.Claims
	key     *ecdsa.PrivateKey
	id      string
	chain   [][]byte
	pins    map[string][]string
	encKeys map[string]*ecdsa.PublicKey
}

func newFleetMachine(i int, pins map[string]any, encKey *ecdsa.PublicKey) *fleetMachine {
	h := sha256.Sum256([]byte(fmt.Sprintf("rotation/%d", i)))
	m := &fleetMachine{i: i, pins: map[string][]string{}, encKeys: map[string]*ecdsa.PublicKey{},
		claims: &agentv1.Claims{
			ProductUuid:   fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16]),
			ProductSerial: fmt.Sprintf("RO-%06d", i),
			Macs:          []string{fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", h[16]&0xfc, h[17], h[18], h[19], h[20], h[21])},
			Hostname:      fmt.Sprintf("rot-%04d", i),
		}}
	m.pins[pki.KindServingCA] = []string{pins["servingCaPin"].(string)}
	m.pins[pki.KindJoinSigning] = []string{pins["joinSigningKeyPin"].(string)}
	enc := pins["joinEncryptionKeyPin"].(string)
	m.pins[pki.KindJoinEncryption] = []string{enc}
	m.encKeys[enc] = encKey
	return m
}

// learn applies statements to every pinned kind.
func (m *fleetMachine) learn(statements []string) {
	for _, kind := range pinnedKinds {
		set, ch := pki.ApplyStatements(kind, m.pins[kind], nil, statements)
		m.pins[kind] = set
		for p, k := range ch.Keys {
			m.encKeys[p] = k
		}
	}
}

// client dials the gateway anew, verifying it against the serving-CA pins,
// presenting the machine's certificate when it has one.
func (m *fleetMachine) client(url string) (agentv1connect.JoinServiceClient, func()) {
	pins := slices.Clone(m.pins[pki.KindServingCA])
	tc := &tls.Config{ServerName: "127.0.0.1", InsecureSkipVerify: true, VerifyConnection: func(cs tls.ConnectionState) error {
		return verifyPinnedSet(cs.PeerCertificates, pins)
	}}
	if m.chain != nil {
		leaf, _ := x509.ParseCertificate(m.chain[0])
		tc.Certificates = []tls.Certificate{{Certificate: m.chain, PrivateKey: m.key, Leaf: leaf}}
	}
	tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
	return agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr, Timeout: 20 * time.Second}, url, connect.WithGRPC()), tr.CloseIdleConnections
}

// verifyPinnedSet accepts a gateway chain whose CA's key is one of pins.
func verifyPinnedSet(presented []*x509.Certificate, pins []string) error {
	if len(presented) < 2 {
		return errors.New("the gateway sent no CA")
	}
	for _, c := range presented[1:] {
		if !c.IsCA || !pki.PinIn(pins, c.PublicKey) {
			continue
		}
		roots := x509.NewCertPool()
		roots.AddCert(c)
		if _, err := presented[0].Verify(x509.VerifyOptions{Roots: roots, DNSName: "127.0.0.1", KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
			return nil
		}
	}
	return errors.New("no serving CA of the pin set signed the gateway's certificate")
}

// accept verifies an answer as bcd does: the statements in its body first
// (each verifies itself against the pins), then the signature under a
// pinned join-signing key, the CSR and the key.
func (m *fleetMachine) accept(body, sig, signingCert, csr []byte, key *ecdsa.PrivateKey) error {
	var b agentv1.JoinResponseBody
	if err := proto.Unmarshal(body, &b); err != nil {
		return err
	}
	m.learn(b.GetKeyStatements())
	cert, err := x509.ParseCertificate(signingCert)
	if err != nil {
		return err
	}
	if !pki.PinIn(m.pins[pki.KindJoinSigning], cert.PublicKey) {
		return errors.New("the answer is signed by a key the machine does not pin")
	}
	if err := pki.VerifyResponse(cert.PublicKey, body, sig); err != nil {
		return err
	}
	sum := sha256.Sum256(csr)
	if !bytes.Equal(b.GetCsrSha256(), sum[:]) || len(b.GetCertChain()) == 0 {
		return errors.New("the answer is not for this CSR")
	}
	leaf, err := x509.ParseCertificate(b.GetCertChain()[0])
	if err != nil || !key.PublicKey.Equal(leaf.PublicKey) {
		return errors.New("the certificate is not for this key")
	}
	m.id, m.chain, m.key = b.GetNodeId(), b.GetCertChain(), key
	return nil
}

// sealKey is the newest join-encryption key the machine pins.
func (m *fleetMachine) sealKey() *ecdsa.PublicKey {
	set := m.pins[pki.KindJoinEncryption]
	for i := len(set) - 1; i >= 0; i-- {
		if k := m.encKeys[set[i]]; k != nil {
			return k
		}
	}
	return nil
}

func (m *fleetMachine) join(ctx context.Context, url, token string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	csr, err := identity.NewCSR(key, "rotation")
	if err != nil {
		return err
	}
	req := &agentv1.JoinRequest{Csr: csr, Protocol: version.ProtocolMax, Claims: m.claims}
	if req.SealedToken, err = pki.Seal(m.sealKey(), token, csr, pki.JoinRequestDigest(req), time.Now()); err != nil {
		return err
	}
	c, done := m.client(url)
	defer done()
	res, err := c.Join(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	return m.accept(res.Msg.GetBody(), res.Msg.GetSig(), res.Msg.GetSigningCertificate(), csr, key)
}

func (m *fleetMachine) renew(ctx context.Context, url string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	csr, err := identity.NewCSR(key, "rotation")
	if err != nil {
		return err
	}
	now := time.Now().UnixMilli()
	pop, err := pki.SignRenewPoP(m.key, csr, m.id, now)
	if err != nil {
		return err
	}
	// R21.2: the pins it holds, as bcd says them, so pki status sees it
	// catch up.
	var pins []string
	for _, kind := range pinnedKinds {
		pins = append(pins, m.pins[kind]...)
	}
	pinsSig, err := pki.SignPinsAck(m.key, pki.CSRHash(csr), pins)
	if err != nil {
		return err
	}
	c, done := m.client(url)
	defer done()
	res, err := c.Renew(ctx, connect.NewRequest(&agentv1.RenewRequest{Csr: csr, Chain: m.chain, ClientTimeUnixMs: now, PopSig: pop, NodeId: m.id, Pins: pins, PinsSig: pinsSig}))
	if err != nil {
		return err
	}
	return m.accept(res.Msg.GetBody(), res.Msg.GetSig(), res.Msg.GetSigningCertificate(), csr, key)
}

// fleet runs machines: each joins, then renews again and again until
// stop, every call over a new connection (as real machines do).
type fleet struct {
	machines []*fleetMachine
	ops      atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	errors   []string
}

func (f *fleet) fail(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errors = append(f.errors, fmt.Sprintf(format, args...))
}

func (f *fleet) run(ctx context.Context, url, token string, workers int) {
	feed := make(chan *fleetMachine)
	go func() {
		defer close(feed)
		for ctx.Err() == nil {
			for _, m := range f.machines {
				select {
				case feed <- m:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	for range workers {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for m := range feed {
				var err error
				what := "renewal"
				if m.id == "" {
					what = "join"
					err = m.join(ctx, url, token)
				} else {
					err = m.renew(ctx, url)
				}
				if err != nil && ctx.Err() == nil {
					f.fail("machine %d: %s: %v", m.i, what, err)
				}
				f.ops.Add(1)
			}
		}()
	}
}

// rotationPlane is serve and a gateway on one SQLite database, as an
// operator runs them.
type rotationPlane struct {
	bc, dir, conf, gwCA string
	secretEnv           []string
	pins                map[string]any
	gwURL, apiURL       string
	cli                 func(args ...string) map[string]any
	op                  *client.Client
	tenant, pool, site  string
}

func startRotationPlane(t *testing.T, certTTL int) *rotationPlane {
	t.Helper()
	// The gateway trusts the API through a CA file of its own, which the
	// rotation replaces.
	gwCA := filepath.Join(t.TempDir(), "gateway-api-ca.pem")
	st := startStack(t, stackOpts{CertTTLSeconds: certTTL, GatewayCAFile: gwCA, beforeGateway: func(st *stack) {
		ca, err := os.ReadFile(filepath.Join(st.dir, "pki", "serving-ca.crt"))
		must(t, err)
		must(t, os.WriteFile(gwCA, ca, 0o644))
	}})
	p := &rotationPlane{bc: st.bc, dir: st.dir, secretEnv: st.secretEnv, pins: st.pins, conf: st.serveConf, gwCA: gwCA,
		gwURL: "https://" + st.gw, apiURL: st.apiURL, tenant: st.tenant, cli: st.cli}
	p.site, p.pool = st.sitePool("rot")
	var err error
	p.op, err = client.New(client.Config{URL: st.apiURL, APIKey: st.apiKey})
	must(t, err)
	return p
}

// pki runs a pki command against the plane's config.
func (p *rotationPlane) pki(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := run(t, p.secretEnv, "", p.bc, append(append([]string{"pki"}, args...), "--config", p.conf)...)
	if code != 0 {
		t.Fatalf("pki %v: %s", args, errOut)
	}
	return out
}

// behind returns pki status's nodes behind, by key.
func (p *rotationPlane) behind(t *testing.T) map[string]int {
	t.Helper()
	st := jsonOf(t, p.pki(t, "status", "--json"))
	out := map[string]int{}
	for _, k := range st["keys"].([]any) {
		k := k.(map[string]any)
		out[k["key"].(string)] = int(k["nodesBehind"].(float64))
	}
	return out
}

// statements waits until the API hands out n key statements: it has
// reloaded the keys the CLI changed.
func (p *rotationPlane) statements(t *testing.T, n int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("the API handing out %d key statements", n), 30*time.Second, func() bool {
		res, err := http.Get(p.apiURL + "/api/compute/.well-known/better-compute")
		if err != nil {
			return false
		}
		defer res.Body.Close()
		var doc struct {
			Join struct {
				KeyStatements []string `json:"keyStatements"`
			} `json:"join"`
		}
		return json.NewDecoder(res.Body).Decode(&doc) == nil && len(doc.Join.KeyStatements) == n
	})
}

// reissue writes new gateway and agent certificates from the serving CA
// in force over the files the gateway and serve read.
func (p *rotationPlane) reissue(t *testing.T) {
	t.Helper()
	for _, name := range []string{"gateway", "agent"} {
		crt, key := filepath.Join(p.dir, name+".crt.new"), filepath.Join(p.dir, name+".key.new")
		p.pki(t, "issue-gateway", "--san", "127.0.0.1", "--cert-out", crt, "--key-out", key)
		must(t, os.Rename(key, filepath.Join(p.dir, name+".key")))
		must(t, os.Rename(crt, filepath.Join(p.dir, name+".crt")))
	}
}

// R16.1, R16.2: every key rotates, one after the other, through prepare,
// activate and retire, while 200 machines keep joining and renewing through
// the gateway and real bcd daemons hold their sessions: no join, renewal
// or session fails, every machine ends on the new keys only (its pin sets
// hold the new pins alone), pki status says no node is behind, and a
// command signed with the new command-signing key runs on every daemon.
func TestRotateEveryKeyUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("a fleet through the rotation of every key (about two minutes)")
	}
	const machines, daemons = 200, 2
	p := startRotationPlane(t, 60)
	_, bcd := binaries(t)
	fleetTok := p.cli("join-tokens", "create", "--tenant", p.tenant, "--pool", p.pool, "--ttl", "1h", "--max-uses", fmt.Sprint(machines))["token"].(string)
	daemonTok := p.cli("join-tokens", "create", "--tenant", p.tenant, "--pool", p.pool, "--ttl", "1h", "--max-uses", fmt.Sprint(daemons))["token"].(string)

	// The daemons, each with its own config (they rewrite it as they
	// learn keys).
	var nodes, confs []string
	for i := range daemons {
		sb := newBCDIn(t, p.dir, fmt.Sprintf("bcd-%d", i), p.gwURL, p.site, p.pins)
		sys, data := filepath.Join(p.dir, fmt.Sprintf("sys-%d", i)), filepath.Join(p.dir, fmt.Sprintf("data-%d", i))
		fakeSysfs(t, sys, fmt.Sprintf("RT-%04d", i), fmt.Sprintf("c1a57e00-0000-4000-8000-%012d", i), fmt.Sprintf("3c:ec:ef:00:20:%02x", i))
		out, errOut, code := run(t, nil, daemonTok+"\n", bcd, "join", "--config", sb.Conf, "--data-dir", data, "--sysfs-root", sys)
		if code != 0 {
			t.Fatalf("bcd join %d: %s\n%s", i, out, errOut)
		}
		nodes = append(nodes, joinedNodeRE.FindStringSubmatch(out + errOut)[1])
		confs = append(confs, sb.Conf)
		start(t, nil, bcd, "run", "--config", sb.Conf, "--data-dir", data)
	}
	waitFor(t, "every daemon's session", 30*time.Second, func() bool { return p.connected(t) == daemons })

	encKey := newBCDIn(t, p.dir, "fleet", p.gwURL, p.site, p.pins).EncKey
	f := &fleet{}
	for i := range machines {
		f.machines = append(f.machines, newFleetMachine(i, p.pins, encKey))
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	f.run(ctx, p.gwURL, fleetTok, 8)
	// cycle waits until every machine made at least one more call.
	cycle := func(what string) {
		t.Helper()
		target := f.ops.Load() + 2*machines
		waitFor(t, what, 60*time.Second, func() bool { return f.ops.Load() >= target })
	}
	caughtUp := func(what string, kinds ...string) {
		t.Helper()
		cycle(what + " (the fleet)")
		waitFor(t, what, 90*time.Second, func() bool {
			b := p.behind(t)
			for _, k := range kinds {
				if b[k] != 0 {
					return false
				}
			}
			return true
		})
	}
	kinds := []string{"node-ca", "serving-ca", "join-signing", "join-encryption", "command-signing"}
	cycle("the fleet joined")

	for _, k := range kinds {
		p.pki(t, "rotate", k, "--phase", "prepare")
		if k == "serving-ca" {
			p.pki(t, "ca-file", "--out", p.gwCA)
		}
	}
	p.statements(t, 3) // a trust statement for each pinned kind
	caughtUp("every node learned the next keys", kinds...)
	for _, k := range kinds {
		p.pki(t, "rotate", k, "--phase", "activate")
		if k == "serving-ca" {
			p.reissue(t)
		}
	}
	caughtUp("every node on the new node CA", kinds...)
	for _, k := range kinds {
		p.pki(t, "rotate", k, "--phase", "retire")
		if k == "serving-ca" {
			p.pki(t, "ca-file", "--out", p.gwCA)
		}
	}
	p.statements(t, 6) // and a retire statement for each
	cycle("the fleet after retire")
	stop()
	f.wg.Wait()

	if len(f.errors) > 0 {
		t.Fatalf("%d failed calls during the rotation, first: %s", len(f.errors), strings.Join(f.errors[:min(5, len(f.errors))], "\n"))
	}
	final := jsonOf(t, p.pki(t, "pins", "--json"))
	want := map[string][]any{pki.KindServingCA: final["servingCaPins"].([]any), pki.KindJoinSigning: final["joinSigningKeyPins"].([]any), pki.KindJoinEncryption: final["joinEncryptionKeyPins"].([]any)}
	for _, m := range f.machines {
		for _, kind := range pinnedKinds {
			if len(want[kind]) != 1 || len(m.pins[kind]) != 1 || m.pins[kind][0] != want[kind][0] {
				t.Fatalf("machine %d pins %s %v, want only %v", m.i, kind, m.pins[kind], want[kind])
			}
		}
	}
	for k, n := range p.behind(t) {
		if n != 0 {
			t.Fatalf("pki status: %d nodes behind on %s", n, k)
		}
	}
	// The daemons' sessions lived through it, and they run a command signed
	// with the new command-signing key.
	if n := p.connected(t); n != daemons {
		t.Fatalf("%d of %d daemons connected after the rotation", n, daemons)
	}
	cctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, node := range nodes {
		cmd, err := p.op.Commands.EnqueueCommand(cctx, connect.NewRequest(&bcv1.EnqueueCommandRequest{TenantId: p.tenant, NodeId: node, Kind: "node.facts", TtlSeconds: 30}))
		must(t, err)
		if state := waitCommand(cctx, p.op, p.tenant, cmd.Msg.GetId()); state != "done" {
			t.Fatalf("node %s: the command after the rotation ended %q", node, state)
		}
	}
	for _, conf := range confs {
		data, err := os.ReadFile(conf)
		must(t, err)
		if !strings.Contains(string(data), want[pki.KindServingCA][0].(string)) {
			t.Fatalf("%s does not hold the new serving CA pin:\n%s", conf, data)
		}
	}
}

// connected counts the plane's connected nodes.
func (p *rotationPlane) connected(t *testing.T) int {
	t.Helper()
	res, err := p.op.Nodes.ListNodes(context.Background(), connect.NewRequest(&bcv1.ListNodesRequest{TenantId: p.tenant, PageSize: 1000}))
	if err != nil {
		return -1
	}
	n := 0
	for _, node := range res.Msg.GetItems() {
		if node.GetConnection() == "connected" {
			n++
		}
	}
	return n
}
