package session

import (
	"context"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// checkHeld ends the sessions among conns that the database says are over,
// in one query for all of them (store.ChangedSessions, which returns only
// the sessions not live as they were opened): the node was
// retired, reclaimed (its identity generation moved), its certificate
// revoked or gone (or its node CA retired), or a newer session of the node holds it on another
// replica, or it was superseded by a renewal longer than
// nodeident.SessionOverlap ago. It is how a change made by any replica ends a session here
// within Check; the replica that made the change also calls EndNode.
func (s *Service) checkHeld(ctx context.Context, conns []*conn) {
	if len(conns) == 0 {
		return
	}
	held := make([]store.HeldSession, len(conns))
	for i, c := range conns {
		held[i] = store.HeldSession{NodeID: c.nodeID, SessionID: c.id, Serial: c.serial, Generation: c.generation}
	}
	var changed []store.SessionState
	err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		changed, err = tx.ChangedSessions(ctx, held)
		return err
	})
	if err != nil {
		s.log.Warn("check held sessions", "sessions", len(conns), "err", err)
		return
	}
	now := s.cfg.Clock.Now()
	for i, c := range conns {
		reason := ""
		if len(changed) > 0 && changed[0].Held == i {
			reason = ended(c, changed[0], now)
			changed = changed[1:]
		}
		if reason == "" && !s.cfg.Core.IssuerAccepted(c.issuerKeyID, c.issuer) {
			// R21.2: its node CA was retired, which refuses the
			// certificate as a revocation does.
			reason = EndRevoked
		}
		if reason != "" {
			s.log.Info("session ended by the control plane", telemetry.LogNodeID, c.nodeID, "session", c.id, telemetry.LogReason, reason)
			cause := endCause(reason)
			if reason == endReplaced {
				cause = errReplaced
			}
			c.end(reason, cause)
		}
	}
}

// ended returns why the database says c is over at now, or "".
func ended(c *conn, st store.SessionState, now time.Time) string {
	switch {
	case !st.NodeFound:
		return endNodeGone
	case st.State == store.NodeRetired:
		return EndRetired
	case st.IdentityGeneration != c.generation:
		return EndReclaimed
	case !st.CertFound || st.CertRevoked || st.CertGeneration != c.generation:
		return EndRevoked
	case st.SessionID != c.id:
		return endReplaced
	case st.CertSupersededAt != nil && !now.Before(st.CertSupersededAt.Add(nodeident.SessionOverlap)):
		// Renewed: bcd reconnects with its new certificate (it does so
		// on its own within its identity check); the old one serves no
		// longer than the overlap.
		return endSuperseded
	}
	return ""
}
