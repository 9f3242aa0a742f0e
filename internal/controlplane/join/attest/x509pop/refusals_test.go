package x509pop_test

import (
	"crypto/x509"
	"errors"
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
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// popCase is one x509pop request: whose leaf, how long after its expiry,
// the client's clock skew, a change to the input, and the refusal.
type popCase struct {
	name          string
	tpm           bool          // the leaf carries a tpm-ak statement
	after         time.Duration // how long after the leaf's expiry (default 1h)
	skew          time.Duration
	otherCA, noCA bool
	mod           func(in *attest.Input)
	reason        string
	// proven: the caller proved the key, so the refusal goes to the
	// node's tenant and names the node and serial.
	proven bool
}

func popCases() []popCase {
	sealed := func(ev *agentv1.X509Pop) []byte { b, _ := proto.Marshal(ev); return b }
	return []popCase{
		{name: "admitted, expired long ago", after: nodeident.MaxExpiredFor - time.Minute},
		{name: "admitted, client 59s ahead", skew: 59 * time.Second},
		{name: "admitted, client 59s behind", skew: -59 * time.Second},
		{name: "token present", mod: func(in *attest.Input) { in.Token = "bcjt_x.y" }, reason: "token-present"},
		{name: "no evidence", mod: func(in *attest.Input) { in.Evidence = nil }, reason: "evidence-missing"},
		{name: "evidence not an X509Pop", mod: func(in *attest.Input) { in.Evidence = []byte{0xff, 0xff} }, reason: "evidence-missing"},
		{name: "no chain", mod: func(in *attest.Input) { in.Evidence = sealed(&agentv1.X509Pop{Sig: []byte("s")}) }, reason: "chain-missing"},
		{name: "leaf not a certificate", mod: func(in *attest.Input) { in.Evidence = sealed(&agentv1.X509Pop{Chain: [][]byte{[]byte("der")}}) },
			reason: "cert-invalid"},
		{name: "signed for another request", mod: func(in *attest.Input) { in.RequestDigest = digest("relayed") }, reason: "sig-invalid"},
		{name: "not yet expired", after: -time.Minute, reason: "cert-not-expired", proven: true},
		{name: "expired too long ago", after: nodeident.MaxExpiredFor, reason: "cert-expired-too-long", proven: true},
		{name: "another node CA", otherCA: true, reason: "cert-chain", proven: true},
		{name: "no node CA", noCA: true, reason: "cert-chain", proven: true},
		{name: "client 61s ahead", skew: 61 * time.Second, reason: "client-time", proven: true},
		{name: "client 61s behind", skew: -61 * time.Second, reason: "client-time", proven: true},
		{name: "another role", mod: func(in *attest.Input) { in.Role = "ramdisk" }, reason: "role-mismatch", proven: true},
		{name: "tpm statement, no key attestation", tpm: true, reason: "key-attestation-missing", proven: true},
	}
}

// R10.5: each refusal of an x509pop re-join, from the evidence's shape to
// the certificate's checks; R13.3: a leaf whose key was proven to be in a
// TPM never re-joins without that proof; R4.7: refusals before the proof
// go to the root tenant, after it to the node's.
func TestAdmitRefusals(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		f := newFixture(t, db)
		plain := f.issue(t, nil, nil, 0)
		tf := *f
		tf.node = storetest.Node(t, db, store.NodeAdopted)
		withTPM := tf.issue(t, []string{tpmStatement(t)}, nil, 0)
		other, err := ca.Generate("example.test", time.Now().Add(-time.Hour))
		must(t, err)
		for _, tc := range popCases() {
			t.Run(tc.name, func(t *testing.T) {
				l, n := plain, f.node
				if tc.tpm {
					l, n = withTPM, tf.node
				}
				after := tc.after
				if after == 0 {
					after = time.Hour
				}
				f.clk.Set(l.cert.NotAfter.Add(after))
				ca := f.bundle.NodeCA
				switch {
				case tc.otherCA:
					ca = other.NodeCA
				case tc.noCA:
					ca = nil
				}
				a := x509pop.New(x509pop.Config{Core: f.core, NodeCAs: func() []*x509.Certificate { return []*x509.Certificate{ca} }})
				in := f.request(t, l, digest(tc.name), tc.skew)
				if tc.mod != nil {
					tc.mod(in)
				}
				adm, err := f.admit(t, a, in, false)
				if tc.reason == "" {
					must(t, err)
					if adm.NodeID != n.ID {
						t.Fatalf("admitted into %s, want %s", adm.NodeID, n.ID)
					}
					return
				}
				tenant := ""
				if tc.proven {
					tenant = n.TenantID
				}
				wantRefusal(t, err, tc.reason, tenant)
				var r *attest.Refusal
				if errors.As(err, &r); tc.proven && (r.NodeID != n.ID || r.Serial != pki.SerialHex(l.cert)) {
					t.Fatalf("refusal names node %s serial %s, want %s %s", r.NodeID, r.Serial, n.ID, pki.SerialHex(l.cert))
				}
			})
		}
	})
}
