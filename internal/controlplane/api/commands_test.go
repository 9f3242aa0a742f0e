package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/structpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

var cmdMachines atomic.Int32

// joined is a node joined through the real JoinService, as bcd holds it.
type joined struct {
	id    string
	m     *jointest.Machine
	chain [][]byte
}

// joinNode joins a new machine into tenant's pool (token made with c).
func joinNode(t testing.TB, e *apitest.Env, c *client.Client, tenant, pool string) joined {
	t.Helper()
	tok := mkToken(t, c, &bcv1.CreateJoinTokenRequest{TenantId: tenant, PoolId: pool})
	m := jointest.NewMachine(t, jointest.Claims(5000+int(cmdMachines.Add(1))))
	res, err := e.Server.Join().Join(context.Background(), m.Request(t, e.Bundle, tok.Token, ""), join.Peer{Addr: "192.0.2.9:1"})
	mustOK(t, err)
	j := m.Verify(t, e.Bundle, res, "")
	return joined{id: j.Body.NodeId, m: m, chain: j.Body.CertChain}
}

// restrict gives the node a current certificate allowing only kinds: the
// join's certificate is revoked and a newer row with the restriction takes
// its place (token joins carry no restriction).
func restrict(t testing.TB, db *store.DB, nodeID string, kinds []string) {
	t.Helper()
	ctx := context.Background()
	mustOK(t, db.WithTx(ctx, func(tx *store.Tx) error {
		n, err := tx.GetNode(ctx, nodeID)
		if err != nil {
			return err
		}
		certs, err := tx.ListNodeCerts(ctx, nodeID, 10)
		if err != nil {
			return err
		}
		for _, c := range certs {
			if _, err := tx.RevokeNodeCert(ctx, c.Serial, "test"); err != nil {
				return err
			}
		}
		b, _ := json.Marshal(kinds)
		now, _ := tx.Now(ctx)
		return tx.InsertNodeCert(ctx, store.NodeCert{Serial: "restricted-" + nodeID, NodeID: nodeID, IdentityGeneration: n.IdentityGeneration, Role: "node",
			SPKISHA256: []byte("x"), DER: []byte("x"), AllowedKinds: b, NotBefore: now, NotAfter: now.Add(time.Hour)})
	}))
}

func enqueue(c *client.Client, tenant, node, kind string, ttl int32) (*bcv1.Command, error) {
	res, err := c.Commands.EnqueueCommand(context.Background(), rq(&bcv1.EnqueueCommandRequest{TenantId: tenant, NodeId: node, Kind: kind, TtlSeconds: ttl}))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// R7.5, R12.3: enqueue refuses kinds outside the node's current
// certificate's allowedKinds with INVALID_STATE; prefix.* allows the
// prefix's kinds; an empty list allows every kind. Kinds are checked for
// syntax (INVALID_ARGUMENT) but unknown kinds queue. R1.2: another tenant's
// node is NOT_FOUND.
func TestEnqueueCommandR7_5(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		free := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		exact := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		restrict(t, e.DB, exact.id, []string{"node.facts"})
		prefix := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		restrict(t, e.DB, prefix.id, []string{"acceptance.*", "gpu.reset"})
		acmeNode := joinNode(t, e, w.acmeAdmin, w.acme, w.acmePool.Id)

		tests := []struct {
			name      string
			c         *client.Client
			tenant    string
			node      string
			kind      string
			ttl       int32
			code      errs.Code // "" : queued
			field     string
			msgHas    string
			wantTTLMs int64
		}{
			{name: "empty allowedKinds allows a built-in", c: e.Admin, tenant: w.root, node: free.id, kind: "node.facts", wantTTLMs: 600_000},
			{name: "empty allowedKinds allows an unknown kind", c: e.Admin, tenant: w.root, node: free.id, kind: "vendor.firmware-update", ttl: 60, wantTTLMs: 60_000},
			{name: "exact kind allowed", c: e.Admin, tenant: w.root, node: exact.id, kind: "node.facts", ttl: 86400, wantTTLMs: 86_400_000},
			{name: "kind outside allowedKinds", c: e.Admin, tenant: w.root, node: exact.id, kind: "acceptance.check", code: errs.InvalidState,
				msgHas: "kind acceptance.check is not allowed for node " + exact.id + "'s certificate (allowed: node.facts)"},
			{name: "prefix.* allows", c: e.Admin, tenant: w.root, node: prefix.id, kind: "acceptance.check"},
			{name: "prefix.* allows deeper kinds", c: e.Admin, tenant: w.root, node: prefix.id, kind: "acceptance.gpu.burn"},
			{name: "prefix.* is not a bare prefix", c: e.Admin, tenant: w.root, node: prefix.id, kind: "acceptancex.check", code: errs.InvalidState,
				msgHas: "(allowed: acceptance.*, gpu.reset)"},
			{name: "another kind refused", c: e.Admin, tenant: w.root, node: prefix.id, kind: "node.facts", code: errs.InvalidState, msgHas: "is not allowed"},
			{name: "bad syntax: one word", c: e.Admin, tenant: w.root, node: free.id, kind: "facts", code: errs.InvalidArgument, field: "kind"},
			{name: "bad syntax: upper case", c: e.Admin, tenant: w.root, node: free.id, kind: "Node.Facts", code: errs.InvalidArgument, field: "kind"},
			{name: "bad syntax: trailing dot", c: e.Admin, tenant: w.root, node: free.id, kind: "node.", code: errs.InvalidArgument, field: "kind"},
			{name: "missing kind", c: e.Admin, tenant: w.root, node: free.id, code: errs.InvalidArgument, field: "kind"},
			{name: "ttl above a day", c: e.Admin, tenant: w.root, node: free.id, kind: "node.facts", ttl: 86401, code: errs.InvalidArgument, field: "ttlSeconds"},
			{name: "negative ttl", c: e.Admin, tenant: w.root, node: free.id, kind: "node.facts", ttl: -1, code: errs.InvalidArgument, field: "ttlSeconds"},
			{name: "R1.2 another tenant's node", c: w.acmeAdmin, tenant: w.acme, node: free.id, kind: "node.facts", code: errs.NotFound, msgHas: "node " + free.id + " not found"},
			{name: "R1.2 node named under the wrong tenant", c: e.Admin, tenant: w.root, node: acmeNode.id, kind: "node.facts", code: errs.NotFound},
			{name: "R1.2 another tenant entirely", c: w.acmeAdmin, tenant: w.root, node: free.id, kind: "node.facts", code: errs.NotFound},
			{name: "unknown node", c: e.Admin, tenant: w.root, node: "node_nosuch", kind: "node.facts", code: errs.NotFound},
			{name: "own node of acme", c: w.acmeAdmin, tenant: w.acme, node: acmeNode.id, kind: "node.facts"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				cmd, err := enqueue(tc.c, tc.tenant, tc.node, tc.kind, tc.ttl)
				if tc.code != "" {
					pe := wantErr(t, err, tc.code, tc.field)
					if !strings.Contains(pe.Message, tc.msgHas) {
						t.Errorf("message %q does not contain %q", pe.Message, tc.msgHas)
					}
					return
				}
				mustOK(t, err)
				if cmd.State != store.CommandQueued || cmd.NodeId != tc.node || cmd.Kind != tc.kind || !strings.HasPrefix(cmd.Id, "cmd_") {
					t.Fatalf("enqueued %v", cmd)
				}
				if tc.wantTTLMs != 0 {
					if got := cmd.ExpiresAt.AsTime().Sub(cmd.CreatedAt.AsTime()).Milliseconds(); got != tc.wantTTLMs {
						t.Errorf("ttl %d ms, want %d", got, tc.wantTTLMs)
					}
				}
				got, err := tc.c.Commands.GetCommand(context.Background(), rq(&bcv1.GetCommandRequest{TenantId: tc.tenant, CommandId: cmd.Id}))
				mustOK(t, err)
				if got.Msg.Id != cmd.Id || got.Msg.State != store.CommandQueued {
					t.Errorf("get %v", got.Msg)
				}
			})
		}

		// The enqueue was evented and audited.
		cmd, err := enqueue(e.Admin, w.root, free.id, "node.facts", 0)
		mustOK(t, err)
		// eventsAfter fails the test unless the event shows up.
		eventsAfter(t, e.Admin, w.root, "", func(ev *bcv1.Event) bool {
			return ev.Type == "command.enqueued" && ev.Subject == free.id && ev.Data.AsMap()["commandId"] == cmd.Id
		})
		found := false
		for _, a := range auditAll(t, e.Admin, w.root) {
			if a.Action == "command.enqueued" && a.Resource == "compute-node/"+free.id && a.Data.AsMap()["commandId"] == cmd.Id {
				found = true
			}
		}
		if !found {
			t.Error("no command.enqueued audit row for", cmd.Id)
		}
	})
}

// R1.2: commands are read and created only with the grants on the node or
// its pool; another tenant's command is NOT_FOUND; lists page newest first.
func TestCommandsReadAndAuthz(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		a := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		b := joinNode(t, e, e.Admin, w.root, w.pool2.Id)
		var ids []string
		for range 3 {
			c, err := enqueue(e.Admin, w.root, a.id, "node.facts", 0)
			mustOK(t, err)
			ids = append(ids, c.Id)
		}
		args, _ := structpb.NewStruct(map[string]any{"minCpus": 2})
		cb, err := e.Admin.Commands.EnqueueCommand(ctx, rq(&bcv1.EnqueueCommandRequest{TenantId: w.root, NodeId: b.id, Kind: "acceptance.check", Args: args}))
		mustOK(t, err)
		if cb.Msg.Args.AsMap()["minCpus"] != float64(2) {
			t.Errorf("args %v", cb.Msg.Args.AsMap())
		}

		// Paging, newest first, one node.
		var got []string
		tok := ""
		for {
			res, err := e.Admin.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.root, NodeId: a.id, PageSize: 2, PageToken: tok}))
			mustOK(t, err)
			for _, c := range res.Msg.Items {
				got = append(got, c.Id)
			}
			if tok = res.Msg.NextPageToken; tok == "" {
				break
			}
		}
		// Newest first by id (time-sortable to the millisecond).
		want := slices.Clone(ids)
		slices.Sort(want)
		slices.Reverse(want)
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("node list %v, want %v", got, want)
		}
		all, err := e.Admin.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.root}))
		mustOK(t, err)
		if len(all.Msg.Items) != 4 || all.Msg.Items[0].Id != max(cb.Msg.Id, want[0]) {
			t.Errorf("tenant list has %d items", len(all.Msg.Items))
		}
		acmeAll, err := w.acmeAdmin.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.acme}))
		mustOK(t, err)
		if len(acmeAll.Msg.Items) != 0 {
			t.Errorf("acme sees %d commands", len(acmeAll.Msg.Items))
		}

		poolReader := e.Client(t, mkKey(t, e.Admin, w.root, "pool-reader", &bcv1.Grant{Action: "compute:commands:read", Resource: "compute-pool/" + w.pool.Id}))
		nodeWriter := e.Client(t, mkKey(t, e.Admin, w.root, "node-writer", &bcv1.Grant{Action: "compute:commands:*", Resource: "compute-node/" + b.id}))
		tests := []struct {
			name string
			call func() error
			code errs.Code
		}{
			{"pool grant reads the pool's node's command", func() error {
				_, err := poolReader.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.root, CommandId: ids[0]}))
				return err
			}, ""},
			{"pool grant lists the pool's node", func() error {
				_, err := poolReader.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.root, NodeId: a.id}))
				return err
			}, ""},
			// R1.2: a node the caller cannot see is
			// answered like a missing one.
			{"pool grant: another pool's node", func() error {
				_, err := poolReader.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.root, CommandId: cb.Msg.Id}))
				return err
			}, errs.NotFound},
			{"pool grant: whole tenant list", func() error {
				_, err := poolReader.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.root}))
				return err
			}, errs.AccessDenied},
			{"read grant cannot enqueue", func() error {
				_, err := enqueue(poolReader, w.root, a.id, "node.facts", 0)
				return err
			}, errs.AccessDenied},
			{"node grant enqueues on its node", func() error {
				_, err := enqueue(nodeWriter, w.root, b.id, "node.facts", 0)
				return err
			}, ""},
			{"node grant: another node", func() error {
				_, err := enqueue(nodeWriter, w.root, a.id, "node.facts", 0)
				return err
			}, errs.NotFound},
			{"node grant: a node that does not exist", func() error {
				_, err := enqueue(nodeWriter, w.root, "node_01kaaaaaaaaaaaaaaaaaaaaaaa", "node.facts", 0)
				return err
			}, errs.NotFound},
			{"R1.2 another tenant's command", func() error {
				_, err := w.acmeAdmin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.acme, CommandId: ids[0]}))
				return err
			}, errs.NotFound},
			{"R1.2 another tenant's node list", func() error {
				_, err := w.acmeAdmin.Commands.ListCommands(ctx, rq(&bcv1.ListCommandsRequest{TenantId: w.acme, NodeId: a.id}))
				return err
			}, errs.NotFound},
			{"unknown command", func() error {
				_, err := e.Admin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.root, CommandId: "cmd_nosuch"}))
				return err
			}, errs.NotFound},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				err := tc.call()
				if tc.code == "" {
					mustOK(t, err)
					return
				}
				wantErr(t, err, tc.code, "")
			})
		}
	})
}

// R12.3: commands nobody delivered or answered before their expiry are
// marked expired by the sweep, with a command.expired event; finished and
// unexpired commands are left alone.
func TestCommandsExpire(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		n := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		short, err := enqueue(e.Admin, w.root, n.id, "node.facts", 60)
		mustOK(t, err)
		sent, err := enqueue(e.Admin, w.root, n.id, "node.facts", 60)
		mustOK(t, err)
		done, err := enqueue(e.Admin, w.root, n.id, "node.facts", 60)
		mustOK(t, err)
		long, err := enqueue(e.Admin, w.root, n.id, "node.facts", 3600)
		mustOK(t, err)
		mustOK(t, e.DB.WithTx(ctx, func(tx *store.Tx) error {
			if _, err := tx.MarkCommandSent(ctx, sent.Id); err != nil {
				return err
			}
			_, err := tx.FinishCommand(ctx, done.Id, store.CommandDone, []byte(`{"cpus":4}`), "")
			return err
		}))
		if got, err := e.Server.Commands().Expire(ctx); err != nil || got != 0 {
			t.Fatalf("expire before the ttl: %d, %v", got, err)
		}
		mustOK(t, e.DB.SetClockOffset(ctx, 2*time.Minute))
		t.Cleanup(func() { _ = e.DB.SetClockOffset(context.Background(), 0) })
		got, err := e.Server.Commands().Expire(ctx)
		mustOK(t, err)
		if got != 2 {
			t.Errorf("expired %d commands, want 2", got)
		}
		tests := []struct {
			id, state, errText string
		}{
			{short.Id, store.CommandExpired, "expired before delivery"},
			{sent.Id, store.CommandExpired, "expired without an answer"},
			{done.Id, store.CommandDone, ""},
			{long.Id, store.CommandQueued, ""},
		}
		for _, tc := range tests {
			res, err := e.Admin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.root, CommandId: tc.id}))
			mustOK(t, err)
			if res.Msg.State != tc.state || res.Msg.Error != tc.errText {
				t.Errorf("%s: %s %q, want %s %q", tc.id, res.Msg.State, res.Msg.Error, tc.state, tc.errText)
			}
			if tc.state == store.CommandExpired && res.Msg.DoneAt == nil {
				t.Errorf("%s: expired without doneAt", tc.id)
			}
			if tc.state == store.CommandDone && res.Msg.Result.AsMap()["cpus"] != float64(4) {
				t.Errorf("%s: result %v", tc.id, res.Msg.Result.AsMap())
			}
		}
		// Events show up once older transactions ended (PostgreSQL): poll.
		seen := map[string]bool{}
		poll.UntilDetail(t, 15*time.Second, func() string {
			return fmt.Sprintf("command.expired events for %s and %s (saw %v)", short.Id, sent.Id, seen)
		}, func() bool {
			seen = map[string]bool{}
			evs, _ := eventsAfter(t, e.Admin, w.root, "", nil)
			for _, ev := range evs {
				if ev.Type == "command.expired" && ev.Subject == n.id {
					seen[ev.Data.AsMap()["commandId"].(string)] = true
				}
			}
			return len(seen) == 2 && seen[short.Id] && seen[sent.Id]
		})
	})
}

// R13.2: retiring a node revokes every certificate (reason retired, a
// security.certificate-revoked event each), fails its pending commands,
// publishes and audits node.retired; the node can then neither renew nor
// take commands. Retiring twice is not an error.
func TestRetireNodeR13_2(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		w := newWorld(t, e)
		n := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		other := joinNode(t, e, e.Admin, w.root, w.pool.Id)
		pending, err := enqueue(e.Admin, w.root, n.id, "node.facts", 0)
		mustOK(t, err)

		tests := []struct {
			name   string
			c      *client.Client
			tenant string
			node   string
			code   errs.Code
		}{
			{name: "R1.2 another tenant", c: w.acmeAdmin, tenant: w.acme, node: n.id, code: errs.NotFound},
			{name: "unknown node", c: e.Admin, tenant: w.root, node: "node_nosuch", code: errs.NotFound},
			{name: "without compute:nodes:update", c: e.Client(t, mkKey(t, e.Admin, w.root, "reader", &bcv1.Grant{Action: "compute:nodes:read", Resource: "*"})),
				tenant: w.root, node: n.id, code: errs.AccessDenied},
			{name: "retire", c: e.Admin, tenant: w.root, node: n.id},
			{name: "retire again", c: e.Admin, tenant: w.root, node: n.id},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				res, err := tc.c.Nodes.RetireNode(ctx, rq(&bcv1.RetireNodeRequest{TenantId: tc.tenant, NodeId: tc.node, Reason: "decommissioned"}))
				if tc.code != "" {
					wantErr(t, err, tc.code, "")
					return
				}
				mustOK(t, err)
				if res.Msg.State != store.NodeRetired || res.Msg.StateReason != "decommissioned" {
					t.Errorf("node %s %q", res.Msg.State, res.Msg.StateReason)
				}
			})
		}

		d, err := e.Admin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: n.id}))
		mustOK(t, err)
		if len(d.Msg.Certs) == 0 {
			t.Fatal("no certificates")
		}
		for _, c := range d.Msg.Certs {
			if c.RevokedAt == nil || c.RevokeReason != "retired" {
				t.Errorf("cert %s: revoked %v reason %q", c.Serial, c.RevokedAt, c.RevokeReason)
			}
		}
		// The other node is untouched.
		od, err := e.Admin.Nodes.GetNode(ctx, rq(&bcv1.GetNodeRequest{TenantId: w.root, NodeId: other.id}))
		mustOK(t, err)
		if od.Msg.State == store.NodeRetired || od.Msg.Certs[0].RevokedAt != nil {
			t.Errorf("other node %s, cert revoked %v", od.Msg.State, od.Msg.Certs[0].RevokedAt)
		}

		pc, err := e.Admin.Commands.GetCommand(ctx, rq(&bcv1.GetCommandRequest{TenantId: w.root, CommandId: pending.Id}))
		mustOK(t, err)
		if pc.Msg.State != store.CommandFailed || pc.Msg.Error != "the node was retired" {
			t.Errorf("pending command %s %q", pc.Msg.State, pc.Msg.Error)
		}
		_, err = enqueue(e.Admin, w.root, n.id, "node.facts", 0)
		if pe := wantErr(t, err, errs.InvalidState, ""); !strings.Contains(pe.Message, "retired") {
			t.Errorf("enqueue on a retired node: %q", pe.Message)
		}

		// Renewal is refused (R13.2).
		req, _ := jointest.RenewRequest(t, n.m.Key, n.chain, n.id, time.Now())
		_, err = e.Server.Join().Renew(ctx, req, join.Peer{Addr: "192.0.2.9:2", Cert: n.chain[0]})
		jointest.WantRenewRefused(t, err)

		evs, _ := eventsAfter(t, e.Admin, w.root, "", isEvent("node.retired", n.id))
		counts := map[string]int{}
		for _, ev := range evs {
			if ev.Subject == n.id {
				counts[ev.Type]++
			}
		}
		if counts["node.retired"] != 1 || counts["security.certificate-revoked"] != len(d.Msg.Certs) {
			t.Errorf("events %v, want one node.retired and %d security.certificate-revoked", counts, len(d.Msg.Certs))
		}
		audits := 0
		for _, a := range auditAll(t, e.Admin, w.root) {
			if a.Action == "node.retired" && a.Resource == "compute-node/"+n.id {
				audits++
			}
		}
		if audits != 1 {
			t.Errorf("%d node.retired audit rows, want 1", audits)
		}
	})
}
