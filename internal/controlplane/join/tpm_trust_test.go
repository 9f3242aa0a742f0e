package join_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// madeAhead inserts a pending node in the fixture's pool (nodes create,
// R11.3): the node a relay would like to bind another machine to.
func (f *fixture) madeAhead(t *testing.T) string {
	t.Helper()
	id := ids.New(ids.Node, time.Now())
	err := f.e.DB.WithTx(context.Background(), func(tx *store.Tx) error {
		_, err := tx.InsertNode(context.Background(), store.Node{ID: id, TenantID: f.pool.OwnerTenantId, SiteID: f.pool.SiteId, PoolID: f.pool.Id,
			Role: pki.RoleNode, State: store.NodePending, Hostname: "made-ahead"})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// R15.2: a tpm join makes a node whatever role the machine asks for; site
// and ramdisk come only from their modules' tokens.
func TestTPMRoleFromPolicyR15_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		for _, role := range []string{pki.RoleSite, pki.RoleRamdisk} {
			_, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256, role: role})
			jointest.WantRefused(t, err)
			if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+tpm.ReasonRole) {
				t.Fatalf("role %s: reasons %v, want %s", role, rs, tpm.ReasonRole)
			}
		}
		for _, role := range []string{"", pki.RoleNode} {
			res, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256, role: role})
			if err != nil {
				t.Fatalf("role %q: %v", role, err)
			}
			body, leaf := leafOf(t, res)
			if got := f.node(t, body.GetNodeId()).Role; got != pki.RoleNode || len(leaf.Subject.OrganizationalUnit) != 1 || leaf.Subject.OrganizationalUnit[0] != "bc-role:node" {
				t.Fatalf("role %q: node role %q, OU %v", role, got, leaf.Subject.OrganizationalUnit)
			}
		}
	})
}

// R15.1: a relay that changes any field of a tpm join, on leg 1, leg 2 or
// both alike, is refused: the node key in the TPM signed the machine's
// request, and the challenge is bound to that same digest. A bcd that does
// not sign is refused too.
func TestTPMRelayRewritesR15_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		ahead := f.madeAhead(t)
		onLegs := func(legs int, mod func(req *agentv1.JoinRequest)) func(int, *agentv1.JoinRequest) {
			return func(leg int, req *agentv1.JoinRequest) {
				if legs == 0 || legs == leg {
					mod(req)
				}
			}
		}
		setNode := func(req *agentv1.JoinRequest) { req.NodeId = ahead }
		for _, tc := range []struct {
			name, reason string
			r            tpmReq
		}{
			{"node_id set on leg 2", tpm.ReasonRequestSig, tpmReq{relay: onLegs(2, setNode)}},
			{"node_id set on both legs", tpm.ReasonRequestSig, tpmReq{relay: onLegs(0, setNode)}},
			{"protocol changed on leg 2", tpm.ReasonRequestSig, tpmReq{relay: onLegs(2, func(req *agentv1.JoinRequest) { req.Protocol++ })}},
			{"claims changed on both legs", tpm.ReasonRequestSig, tpmReq{relay: onLegs(0, func(req *agentv1.JoinRequest) { req.Claims.Hostname = "elsewhere" })}},
			{"role changed on both legs", tpm.ReasonRole, tpmReq{relay: onLegs(0, func(req *agentv1.JoinRequest) { req.Role = pki.RoleSite })}},
			{"signature dropped", tpm.ReasonRequestSig, tpmReq{relay: onLegs(0, func(req *agentv1.JoinRequest) { req.RequestSig = nil })}},
			{"bcd that does not sign", tpm.ReasonRequestSig, tpmReq{unsigned: true}},
		} {
			tc.r.kind = tpmdevice.EKP256
			before := len(f.nodes(t, f.root))
			_, _, err := env.join(t, tc.r)
			jointest.WantRefused(t, err)
			if rs := jointest.Reasons(t, e.DB, e.RootTenant); !contains(rs, tpm.Name+":"+tc.reason) {
				t.Fatalf("%s: reasons %v, want %s", tc.name, rs, tc.reason)
			}
			if n := f.node(t, ahead); n.State != store.NodePending || n.IdentityGeneration != 0 {
				t.Fatalf("%s: the node made ahead was bound: %+v", tc.name, n)
			}
			if after := len(f.nodes(t, f.root)); after != before {
				t.Fatalf("%s: %d nodes, want %d", tc.name, after, before)
			}
		}
	})
}

// R15.1, R4.9: leg 2 replayed, as sent or with its protocol, its answer's
// encoding or its signature changed, and after the challenge expired,
// gets the stored answer or a refusal: one join stays one node.
func TestTPMReplayVariantsR15_1(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		f := newFixture(t, e)
		env := newTPMEnv(t, f, f.trustCAs(t))
		var leg2 *agentv1.JoinRequest
		res, _, err := env.join(t, tpmReq{kind: tpmdevice.EKP256, relay: func(leg int, req *agentv1.JoinRequest) {
			if leg == 2 {
				leg2 = proto.CloneOf(req)
			}
		}})
		if err != nil {
			t.Fatal(err)
		}
		body, _ := leafOf(t, res)
		nodes := len(f.nodes(t, f.root))
		// An answer with a field the daemon never sends: the same secret
		// and expiry, other bytes.
		reencoded := protowire.AppendTag(append([]byte(nil), leg2.GetChallengeResponse()...), 99, protowire.BytesType)
		reencoded = protowire.AppendBytes(reencoded, []byte("relay"))
		for _, tc := range []struct {
			name    string
			mod     func(req *agentv1.JoinRequest)
			advance time.Duration
			stored  bool
		}{
			{"as sent", func(*agentv1.JoinRequest) {}, 0, true},
			{"answer re-encoded", func(req *agentv1.JoinRequest) { req.ChallengeResponse = reencoded }, 0, true},
			{"answer re-encoded, challenge expired", func(req *agentv1.JoinRequest) { req.ChallengeResponse = reencoded }, tpm.ChallengeTTL + time.Second, true},
			{"protocol changed", func(req *agentv1.JoinRequest) { req.Protocol += 7 }, 0, false},
			{"role spelled out", func(req *agentv1.JoinRequest) { req.Role = pki.RoleNode }, 0, false},
			{"signature re-signed by another key", func(req *agentv1.JoinRequest) { signTPMRequest(t, jointest.Key(t), req) }, 0, true},
		} {
			env.clk.Advance(tc.advance)
			req := proto.CloneOf(leg2)
			tc.mod(req)
			got, err := env.svc.Join(context.Background(), req, join.Peer{Addr: "192.0.2.9:1"})
			switch {
			case tc.stored && err != nil:
				t.Fatalf("%s: %v, want the stored answer", tc.name, err)
			case tc.stored && !proto.Equal(got, res):
				t.Fatalf("%s: an answer other than the stored one", tc.name)
			case !tc.stored:
				jointest.WantRefused(t, err)
			}
			if n := len(f.nodes(t, f.root)); n != nodes {
				t.Fatalf("%s: %d nodes after the replay, want %d", tc.name, n, nodes)
			}
			if n := f.node(t, body.GetNodeId()); n.IdentityGeneration != 1 {
				t.Fatalf("%s: the node moved to generation %d", tc.name, n.IdentityGeneration)
			}
		}
	})
}
