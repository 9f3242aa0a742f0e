package x509pop_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/x509pop"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
)

// certTTL is the lifetime of the fixture's node certificates.
const certTTL = time.Hour

// fixture is a node with certificates issued by the identity core, on a
// fake clock the attestor shares.
type fixture struct {
	db     *store.DB
	clk    *clock.Fake
	core   *nodeident.Core
	bundle *ca.Bundle
	node   store.Node
}

func newFixture(t *testing.T, db *store.DB) *fixture {
	t.Helper()
	now := time.Now()
	b, err := ca.Generate("example.test", now.Add(-time.Hour))
	must(t, err)
	clk := clock.NewFake(now)
	core, err := nodeident.New(nodeident.Config{DB: db, Bundle: b, Clock: clk, CertTTL: certTTL})
	must(t, err)
	return &fixture{db: db, clk: clk, core: core, bundle: b, node: storetest.Node(t, db, store.NodeAdopted)}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// leaf is an issued certificate and its key.
type leaf struct {
	key  *ecdsa.PrivateKey
	cert *x509.Certificate
	der  []byte
}

// issue issues n a certificate as a join does, at the clock's now.
func (f *fixture) issue(t *testing.T, statements, kinds []string, maxTTL time.Duration) leaf {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	var is *nodeident.Issued
	ctx := context.Background()
	must(t, f.db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		is, err = f.core.Issue(ctx, tx, nodeident.IssueParams{Pub: &key.PublicKey, CSRSHA256: make([]byte, 32), Node: f.node,
			Role: f.node.Role, Statements: statements, AllowedKinds: kinds, MaxTTL: maxTTL})
		return err
	}))
	return leaf{key: key, cert: is.Cert.Cert, der: is.Cert.DER}
}

// request is the x509pop input bcd sends for digest, signed by l's key,
// with its client time at the clock's now plus skew.
func (f *fixture) request(t *testing.T, l leaf, digest []byte, skew time.Duration) *attest.Input {
	t.Helper()
	sig, err := pki.SignX509Pop(l.key, digest)
	must(t, err)
	ev, err := proto.Marshal(&agentv1.X509Pop{Chain: [][]byte{l.der}, ClientTimeUnixMs: f.clk.Now().Add(skew).UnixMilli(), Sig: sig})
	must(t, err)
	return &attest.Input{Role: "node", RequestDigest: digest, Evidence: ev}
}

// admit runs Admit, and Spend when spend is set, in one transaction.
func (f *fixture) admit(t *testing.T, a *x509pop.Attestor, in *attest.Input, spend bool) (*attest.Admission, error) {
	t.Helper()
	ctx := context.Background()
	var adm *attest.Admission
	err := f.db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		if adm, err = a.Admit(ctx, tx, in); err != nil || !spend {
			return err
		}
		return adm.Spend(ctx, tx)
	})
	return adm, err
}

func digest(s string) []byte { d := sha256.Sum256([]byte(s)); return d[:] }

// R10.5: an expired certificate re-joins its own node: the admission names
// it, keeps its pool, site, role, kinds and statements, and never
// lengthens its lifetime; Admit only reads, Spend records the proof once.
func TestAdmission(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		f := newFixture(t, db)
		l := f.issue(t, nil, []string{"exec"}, 30*time.Minute)
		f.clk.Set(l.cert.NotAfter.Add(time.Hour))
		a := x509pop.New(x509pop.Config{Core: f.core, NodeCAs: f.bundle.TrustedNodeCAs})
		in := f.request(t, l, digest("leg"), 0)
		adm, err := f.admit(t, a, in, false)
		must(t, err)
		got := *adm
		got.Spend = nil
		want := attest.Admission{TenantID: f.node.TenantID, PoolID: f.node.PoolID, SiteID: f.node.SiteID, Role: "node", NodeID: f.node.ID,
			NodeKey: "unattested", AllowedKinds: []string{"exec"}, Statements: []string{}, MaxTTL: 30 * time.Minute}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("admission = %+v\nwant        %+v", got, want)
		}
		// Admit recorded nothing: the same evidence admits and spends once.
		_, err = f.admit(t, a, in, true)
		must(t, err)
		_, err = f.admit(t, a, in, true)
		wantRefusal(t, err, "proof-replayed", f.node.TenantID)
		// A new request signed anew is another proof.
		_, err = f.admit(t, a, f.request(t, l, digest("retry"), 0), true)
		must(t, err)
	})
}

// R10.5: the replay record is the signed message's hash under its own
// domain: one per request digest, never a renewal proof's.
func TestProofHash(t *testing.T) {
	a, b := x509pop.ProofHash(digest("a")), x509pop.ProofHash(digest("a"))
	if !bytes.Equal(a, b) || bytes.Equal(a, x509pop.ProofHash(digest("b"))) {
		t.Fatal("ProofHash must be a function of the digest alone")
	}
	plain := sha256.Sum256(pki.X509PopMessage(digest("a")))
	if bytes.Equal(a, plain[:]) {
		t.Fatal("ProofHash must be domain-separated from the signed message's hash")
	}
}

// wantRefusal fails unless err is a refusal for reason, routed to tenant.
func wantRefusal(t *testing.T, err error, reason, tenant string) {
	t.Helper()
	var r *attest.Refusal
	if !errors.As(err, &r) {
		t.Fatalf("want refusal %s, got %v", reason, err)
	}
	if r.Reason != reason || r.TenantID != tenant {
		t.Fatalf("refusal %s to tenant %q, want %s to %q", r.Reason, r.TenantID, reason, tenant)
	}
}

// tpmStatement is an urn:bc:tpm-ak: statement for a made-up AK name.
func tpmStatement(t *testing.T) string {
	t.Helper()
	s, err := tpmverify.Statement(append([]byte{0x00, 0x0b}, digest("ak")...))
	must(t, err)
	return s
}
