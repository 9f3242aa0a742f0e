package nodes_test

import (
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/nodes"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/errs/errstest"
)

// R13.2, R12.1: retiring a node, in one transaction, makes it retired with
// the reason, revokes its certificates ("retired"), fails its pending
// commands and ends its session after the commit. Again changes nothing.
func TestRetire(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		n, serial, cmd := f.joined(t, f.gpu)
		got, err := f.svc.Retire(ctx, f.admin, f.acme, n.ID, "  decommissioned  ")
		errstest.Must(t, err)
		if got.State != store.NodeRetired || got.StateReason != "decommissioned" {
			t.Fatalf("retired node = %s %q", got.State, got.StateReason)
		}
		if id := f.sessionEnded(t); id != n.ID {
			t.Fatalf("session of %s ended, want %s", id, n.ID)
		}
		errstest.Must(t, db.ReadTx(ctx, func(tx *store.Tx) error {
			c, err := tx.GetNodeCert(ctx, serial)
			if err != nil {
				return err
			}
			if c.RevokedAt == nil || c.RevokeReason != nodes.RevokeReasonRetired {
				t.Errorf("certificate revoked %v reason %q", c.RevokedAt, c.RevokeReason)
			}
			k, err := tx.GetCommand(ctx, cmd)
			if err != nil {
				return err
			}
			if k.State == "queued" || k.State == "sent" || k.Error != "the node was retired" {
				t.Errorf("command %s %q, want failed by the retirement", k.State, k.Error)
			}
			return nil
		}))
		data := f.retiredEvent(t)
		if data["previousState"] != store.NodeAdopted || data["reason"] != "decommissioned" ||
			!reflect.DeepEqual(data["revokedSerials"], []any{serial}) || !reflect.DeepEqual(data["failedCommands"], []any{cmd}) {
			t.Fatalf("node.retired data = %v", data)
		}
		if c := f.events(t, f.acme, "security.certificate-revoked"); c != 1 {
			t.Fatalf("%d certificate-revoked events, want 1", c)
		}

		again, err := f.svc.Retire(ctx, f.admin, f.acme, n.ID, "other")
		if err != nil || again.StateReason != "decommissioned" {
			t.Fatalf("retire again: %q, %v; want unchanged", again.StateReason, err)
		}
		// Again still ends a session the node might hold on this replica.
		if id := f.sessionEnded(t); id != n.ID {
			t.Fatalf("session of %s ended, want %s", id, n.ID)
		}
		if c := f.events(t, f.acme, "node.retired"); c != 1 {
			t.Fatalf("%d node.retired events, want 1", c)
		}
	})
}

// retiredEvent is the data of acme's one node.retired event.
func (f *fixture) retiredEvent(t *testing.T) map[string]any {
	t.Helper()
	ctx := context.Background()
	errstest.Must(t, f.db.WaitEventsVisible(ctx, f.acme, 10*time.Second))
	var data map[string]any
	errstest.Must(t, f.db.ReadTx(ctx, func(tx *store.Tx) error {
		evs, err := tx.ListEvents(ctx, f.acme, 0, 0, "node.retired", 10)
		if err != nil || len(evs) != 1 {
			t.Fatalf("node.retired events: %d, %v", len(evs), err)
		}
		return json.Unmarshal(evs[0].Data, &data)
	}))
	return data
}

// R13.2: the reason is one line of at most 256 characters, and defaults;
// R1.2: a node the caller cannot see is NOT_FOUND, one it can see but not
// update is ACCESS_DENIED.
func TestRetireRefusals(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		f := newFixture(t, db)
		n, _, _ := f.joined(t, f.gpu)
		reader := f.grants(authz.Grant{Action: authz.NodesRead, Resource: authz.PoolResource(f.gpu.ID)})
		stranger := f.grants(authz.Grant{Action: authz.NodesUpdate, Resource: authz.PoolResource(f.cpu.ID)})
		notFound := "node " + n.ID + " not found"
		for _, tc := range []struct {
			name   string
			p      authz.Principal
			tenant string
			node   string
			reason string
			code   errs.Code
			msg    string
		}{
			{"reason too long", f.admin, f.acme, n.ID, strings.Repeat("r", 257), errs.InvalidArgument, "reason: at most 256 characters on one line"},
			{"reason on two lines", f.admin, f.acme, n.ID, "a\nb", errs.InvalidArgument, "reason: at most 256 characters on one line"},
			{"no node", f.admin, f.acme, "", "", errs.InvalidArgument, "nodeId: required"},
			{"missing node", f.admin, f.acme, "node_missing", "", errs.NotFound, "node node_missing not found"},
			{"another tenant", f.globAdm, f.globex, n.ID, "", errs.NotFound, notFound},
			{"sees it, may not update", reader, f.acme, n.ID, "", errs.AccessDenied, "compute:nodes:update is not allowed on compute-node/" + n.ID},
			{"cannot see it", stranger, f.acme, n.ID, "", errs.NotFound, notFound},
		} {
			t.Run(tc.name, func(t *testing.T) {
				_, err := f.svc.Retire(ctx, tc.p, tc.tenant, tc.node, tc.reason)
				errstest.Want(t, err, tc.code, tc.msg)
			})
		}
		// Granted on the node itself, with no reason: the default one.
		got, err := f.svc.Retire(ctx, f.grants(authz.Grant{Action: authz.NodesUpdate, Resource: nodes.Resource(n.ID)}), f.acme, n.ID, " ")
		if err != nil || got.StateReason != "retired by an operator" {
			t.Fatalf("retire with the default reason: %q, %v", got.StateReason, err)
		}
		// The first session ended is this one's: no refused call ended any.
		if id := f.sessionEnded(t); id != n.ID {
			t.Fatalf("session of %s ended, want %s", id, n.ID)
		}
		// A pending node made ahead retires too, with nothing to revoke.
		p, err := f.svc.Create(ctx, f.admin, nodes.CreateRequest{TenantID: f.acme, PoolID: f.gpu.ID})
		errstest.Must(t, err)
		if got, err := f.svc.Retire(ctx, f.admin, f.acme, p.ID, ""); err != nil || got.State != store.NodeRetired {
			t.Fatalf("retire a pending node: %+v, %v", got, err)
		}
	})
}
