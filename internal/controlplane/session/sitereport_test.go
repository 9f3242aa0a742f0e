package session

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R10.4: a site agent's report records vouches for its own site, signed by
// its node key over the session's nonce, in sequence; anything else ends
// the session with a reason and records nothing.
func TestSiteReport(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		s := New(Config{DB: db})
		agent := storetest.Node(t, db, store.NodeAdopted)
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		nonce := make([]byte, pki.SessionNonceSize)
		_, _ = rand.Read(nonce)
		other := make([]byte, pki.SessionNonceSize)
		_, _ = rand.Read(other)
		site := &conn{nodeID: agent.ID, tenantID: agent.TenantID, siteID: agent.SiteID, role: pki.RoleSite, nodeKey: key.Public(), nonce: nonce}
		report := func(n []byte, seq uint64, ms ...*agentv1.BootedMachine) *agentv1.SiteReport {
			body, err := proto.Marshal(&agentv1.SiteReportBody{Seq: seq, Machines: ms})
			if err != nil {
				t.Fatal(err)
			}
			sig, err := pki.SignSiteReport(key, n, body)
			if err != nil {
				t.Fatal(err)
			}
			return &agentv1.SiteReport{Body: body, Sig: sig}
		}
		booted := func(mac, ip string, epoch int64) *agentv1.BootedMachine {
			return &agentv1.BootedMachine{Mac: mac, Ip: ip, LeaseEpoch: epoch}
		}
		vouches := func(mac string) []store.SiteVouch {
			var out []store.SiteVouch
			if err := db.ReadTx(context.Background(), func(tx *store.Tx) (err error) {
				out, err = tx.SiteVouchesByMAC(context.Background(), agent.TenantID, mac)
				return
			}); err != nil {
				t.Fatal(err)
			}
			return out
		}
		tampered := report(nonce, 9, booted("00:1b:21:00:00:09", "10.0.0.9", 1))
		tampered.Body[len(tampered.Body)-1] ^= 1
		nodeRole := &conn{nodeID: agent.ID, tenantID: agent.TenantID, siteID: agent.SiteID, role: pki.RoleNode, nodeKey: key.Public(), nonce: nonce}
		for _, st := range []struct {
			name   string
			c      *conn
			r      *agentv1.SiteReport
			reason string
		}{
			{"a site agent's report", site, report(nonce, 1, booted("00-1B-21-00-00-01", "10.0.0.1", 3)), ""},
			{"the same report again (a relay's replay)", site, report(nonce, 1, booted("00:1b:21:00:00:02", "10.0.0.2", 1)), reasonSiteReportSignature},
			{"another session's", site, report(other, 2, booted("00:1b:21:00:00:02", "10.0.0.2", 1)), reasonSiteReportSignature},
			{"altered on the way", site, tampered, reasonSiteReportSignature},
			{"a node that is not a site agent", nodeRole, report(nonce, 5, booted("00:1b:21:00:00:02", "10.0.0.2", 1)), reasonSiteReportRole},
			{"a locally administered MAC", site, report(nonce, 6, booted("52:54:00:00:00:02", "10.0.0.2", 1)), reasonSiteReportInvalid},
			{"no lease epoch", site, report(nonce, 7, booted("00:1b:21:00:00:02", "10.0.0.2", 0)), reasonSiteReportInvalid},
			{"an older epoch changes nothing", site, report(nonce, 8, booted("00:1b:21:00:00:01", "10.0.0.99", 2)), ""},
		} {
			t.Run(st.name, func(t *testing.T) {
				err := s.siteReport(context.Background(), st.c, st.r)
				var r *refusal
				switch {
				case st.reason == "" && err != nil:
					t.Fatalf("refused: %v", err)
				case st.reason != "" && (!errors.As(err, &r) || r.reason != st.reason):
					t.Fatalf("got %v, want a refusal with reason %s", err, st.reason)
				}
			})
		}
		v := vouches("00:1b:21:00:00:01")
		if len(v) != 1 || v[0].SiteID != agent.SiteID || v[0].VouchedBy != agent.ID || v[0].IP != "10.0.0.1" || v[0].LeaseEpoch != 3 {
			t.Fatalf("vouches %+v: want the first report's, for the agent's site", v)
		}
		if v := vouches("00:1b:21:00:00:02"); len(v) != 0 {
			t.Fatalf("a refused report recorded %+v", v)
		}
	})
}
