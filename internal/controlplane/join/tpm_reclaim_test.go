package join_test

import (
	"fmt"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// R15.3, R9.2: a machine whose disk was wiped (a new node key, other
// claims, the same TPM) joins with the tpm attestor again. Under its pool's
// allow_reclaim the same EK and AK take back the node they belong to: the
// same id, the next identity generation, a node.reclaimed audit row, the
// old certificate revoked. Without allow_reclaim it is another node, as before.
func TestTPMReclaimR15_3(t *testing.T) {
	for _, allow := range []bool{true, false} {
		t.Run(fmt.Sprintf("allow_reclaim=%v", allow), func(t *testing.T) { tpmReclaim(t, allow) })
	}
}

func tpmReclaim(t *testing.T, allow bool) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		trust := f.trustCAs(t)
		env := newTPMEnv(t, f, func(sim *tpmtest.Sim, tp *tpmdevice.TPM) []tpm.Pool {
			pools := trust(sim, tp)
			pools[0].AllowReclaim = allow
			return pools
		})
		first, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256})
		if err != nil {
			t.Fatal(err)
		}
		b1, _ := leafOf(t, first)
		// The disk is wiped: bcd makes a new key; the claims differ
		// (tpmReq numbers them), the TPM is the same.
		again, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256})
		if err != nil {
			t.Fatalf("allow_reclaim=%v: the second join: %v", allow, err)
		}
		b2, _ := leafOf(t, again)
		if !allow {
			if b2.GetNodeId() == b1.GetNodeId() {
				t.Fatal("without allow_reclaim the TPM took its node back")
			}
			return
		}
		if b2.GetNodeId() != b1.GetNodeId() || b2.GetIdentityGeneration() != 2 {
			t.Fatalf("the reclaim made node %s generation %d, want %s generation 2", b2.GetNodeId(), b2.GetIdentityGeneration(), b1.GetNodeId())
		}
		reclaimed := false
		for _, a := range f.audit(t, e.RootTenant, "node.reclaimed") {
			if a.Resource == "compute-node/"+b1.GetNodeId() {
				reclaimed = true
			}
		}
		if !reclaimed {
			t.Fatal("no node.reclaimed audit row")
		}
		revoked := false
		for _, ev := range f.events(t, e.RootTenant, "security.certificate-revoked") {
			if ev.Subject == b1.GetNodeId() && ev.Data["reason"] == "reclaimed" {
				revoked = true
			}
		}
		if !revoked {
			t.Fatal("the first certificate was not revoked as reclaimed")
		}
		if n := f.node(t, b1.GetNodeId()); n.Attestor != tpm.Name || n.NodeKey != tpm.NodeKeyTPM {
			t.Fatalf("the reclaimed node: attestor %q node key %q", n.Attestor, n.NodeKey)
		}
	})
}
