package jointest

import (
	"context"
	"crypto"
	"encoding/json"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// RenewRefusedMessage is the only message a refused renewal sees (R13.5).
const RenewRefusedMessage = "Renew refused"

// RenewRequest returns what bcd sends to renew: a new key's CSR (returned as
// a Machine without claims), the current chain, clientTime and the proof of
// possession signed by current.
func RenewRequest(t testing.TB, current crypto.Signer, chain [][]byte, nodeID string, clientTime time.Time) (*agentv1.RenewRequest, *Machine) {
	t.Helper()
	next := Key(t)
	csr := CSR(t, next)
	ms := clientTime.UnixMilli()
	sig, err := pki.SignRenewPoP(current, csr, nodeID, ms)
	if err != nil {
		t.Fatal(err)
	}
	return &agentv1.RenewRequest{Csr: csr, Chain: chain, ClientTimeUnixMs: ms, PopSig: sig, NodeId: nodeID}, &Machine{Key: next, CSR: csr}
}

// VerifyRenewal checks a renewal answer exactly as a join answer (R4.6): it
// has the same shape and signature.
func (m *Machine) VerifyRenewal(t testing.TB, b *ca.Bundle, res *agentv1.RenewResponse, wantRole string) *Joined {
	t.Helper()
	return m.Verify(t, b, &agentv1.JoinResponse{Body: res.GetBody(), Sig: res.GetSig(), SigningCertificate: res.GetSigningCertificate()}, wantRole)
}

// WantRenewRefused fails unless err is exactly what a refused renewal sees:
// ACCESS_DENIED "Renew refused".
func WantRenewRefused(t testing.TB, err error) {
	t.Helper()
	WantError(t, err, errs.AccessDenied, RenewRefusedMessage)
}

// RenewRefusal is a security.renew.refused event's data.
type RenewRefusal struct {
	Reason     string `json:"reason"`
	NodeID     string `json:"nodeId"`
	CSRSHA256  string `json:"csrSha256"`
	CertSerial string `json:"certSerial"`
	Suppressed int    `json:"suppressed"`
}

// RenewRefusals reads every security.renew.refused event of tenant, oldest
// first.
func RenewRefusals(t testing.TB, db *store.DB, tenant string) []RenewRefusal {
	t.Helper()
	ctx := context.Background()
	if err := db.WaitEventsVisible(ctx, tenant, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	var out []RenewRefusal
	err := db.ReadTx(ctx, func(tx *store.Tx) error {
		evs, err := tx.ListEvents(ctx, tenant, 0, 0, "security.renew.refused", 10000)
		for _, e := range evs {
			var r RenewRefusal
			if err := json.Unmarshal(e.Data, &r); err != nil {
				return err
			}
			out = append(out, r)
		}
		return err
	})
	if err != nil {
		t.Fatalf("read renew refusals: %v", err)
	}
	return out
}
