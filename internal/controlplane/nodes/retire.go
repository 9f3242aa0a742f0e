package nodes

import (
	"context"
	"errors"
	"strings"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// RevokeReasonRetired is the revoke reason of a retired node's
// certificates.
const RevokeReasonRetired = "retired"

const maxReason = 256

// Retire retires the tenant's node (R13.2): in one transaction its state
// becomes retired, every unrevoked certificate is revoked (reason
// "retired", a security.certificate-revoked event each), its queued and
// sent commands fail, and node.retired is published and audited; after
// the commit its live session on this replica ends. A retired node can
// neither renew nor open a session, and its hardware key is free for a
// new join. Retiring a retired node changes nothing and is not an error.
func (s *Service) Retire(ctx context.Context, p authz.Principal, tenantID, nodeID, reason string) (store.Node, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.Node{}, err
	}
	if nodeID == "" {
		return store.Node{}, errs.Invalid("nodeId", "required")
	}
	reason = strings.TrimSpace(reason)
	if len(reason) > maxReason || strings.ContainsAny(reason, "\r\n\x00") {
		return store.Node{}, errs.Invalid("reason", "at most %d characters on one line", maxReason)
	}
	if reason == "" {
		reason = "retired by an operator"
	}
	var out store.Node
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		n, err := tx.GetNode(ctx, nodeID)
		if errors.Is(err, store.ErrNotFound) || err == nil && n.TenantID != tenantID {
			return errs.New(errs.NotFound, "node %s not found", nodeID)
		}
		if err != nil {
			return err
		}
		res := Resource(n.ID)
		if !p.Allowed(authz.NodesUpdate, res) && !p.Allowed(authz.NodesUpdate, authz.PoolResource(n.PoolID)) {
			if p.TenantID != tenantID || !canSee(p, n) {
				// R1.2: no existence leak.
				return errs.New(errs.NotFound, "node %s not found", nodeID)
			}
			return errs.New(errs.AccessDenied, "%s is not allowed on %s", authz.NodesUpdate, res)
		}
		if s.cfg.EndSession != nil {
			id := n.ID
			tx.AfterCommit(func() { s.cfg.EndSession(id) })
		}
		if n.State == store.NodeRetired {
			out = n
			return nil
		}
		if err := tx.SetNodeState(ctx, n.ID, store.NodeRetired, reason); err != nil {
			return err
		}
		serials, err := tx.RevokeAllNodeCerts(ctx, n.ID, RevokeReasonRetired)
		if err != nil {
			return err
		}
		for _, serial := range serials {
			if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "security.certificate-revoked", Subject: n.ID,
				Data: map[string]any{"nodeId": n.ID, "serial": serial, "reason": RevokeReasonRetired}}); err != nil {
				return err
			}
		}
		failed, err := tx.FailPendingCommands(ctx, n.ID, "the node was retired")
		if err != nil {
			return err
		}
		data := map[string]any{"nodeId": n.ID, "poolId": n.PoolID, "previousState": n.State, "reason": reason, "identityGeneration": n.IdentityGeneration,
			"revokedSerials": nonNil(serials), "failedCommands": nonNil(failed)}
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.retired", Subject: n.ID, Data: data}); err != nil {
			return err
		}
		if err := events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: p.ID, Action: "node.retired", Resource: res, Data: data}); err != nil {
			return err
		}
		out, err = tx.GetNode(ctx, n.ID)
		return err
	})
	return out, err
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
