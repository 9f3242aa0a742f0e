package session

import (
	"container/heap"
	"context"
	"slices"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// The held-session check (R12.1): every Check (500 ms) a replica ends the
// sessions it holds that are over. In memory: idle ones (no heartbeat for
// three intervals) and those whose certificate expired, each looked at
// when its deadline passes (a heap of deadlines, the earlier of its last
// heartbeat plus the idle time and its certificate's expiry; a session
// that beat since is put back at its new deadline), so a Check looks at
// the few sessions due, not at every one. In the database: the node was
// retired, reclaimed (its identity generation moved), its certificate
// revoked or gone, a newer session of the node holds it on another
// replica, or a renewal superseded the certificate longer than
// nodeident.SessionOverlap ago; and the certificate's node CA was retired
// (R21.2, from the live bundle).
//
// The database side costs what changed, not what is held. Every change
// that can end a session writes a row of the session change feed in its
// own transaction (store.SessionFeed, triggers of migration 00025). Each
// Check reads the rows after this replica's position and runs
// store.ChangedSessions only for:
//   - the sessions it holds of the nodes those rows name;
//   - the sessions registered since the last Check (their authentication
//     may have read the database just before a change whose row this
//     replica read before it held them);
//   - the sessions superseded by a renewal whose overlap ends now (the
//     due list: the change was read when the renewal committed, the
//     session ends SessionOverlap later);
//   - and, only when the live bundle changed (a rotation), every session's
//     issuer is checked against it in memory.
//
// The check of every held session against the database (what every Check
// did before the feed) stays as the safety net: spread over the Checks of
// sweepEvery, a slice of the held sessions each (so that no Check takes
// long: a whole sweep of 100,000 sessions takes seconds, and the changes
// the feed names would wait for it), and whole at once at the next Check
// after a feed read failed or reported that changes may have been missed
// (store.SessionFeed.Read), and at the first Check after the poll starts
// (a replica's start, or its first session after holding none: the feed
// has no position yet). After each sweep the feed rows every reader is
// done with are pruned.
//
// The process that makes a change also calls EndNode, which ends its own
// replica's session at once; the feed is how a change made by any replica
// ends a session here within a Check.

// defaultSweep is how often every held session is checked against the
// database whatever the feed says: the bound on how long a change the
// feed missed (a commit slower than store.FeedGapWait) keeps a session.
const defaultSweep = time.Minute

// heldState is what the held-session check keeps between Checks. The poll
// goroutine owns it (one runs at a time; s.mu orders them).
type heldState struct {
	feed store.SessionFeed
	// sweepEvery is the safety net's cadence (defaultSweep; tests change
	// it); lastSweep is when the last one began.
	sweepEvery time.Duration
	lastSweep  time.Time
	// sweepLeft holds the sessions the running sweep has still to check,
	// sweepStep how many it checks a Check.
	sweepLeft []*conn
	sweepStep int
	// issuers is the live bundle the last issuer check of every held
	// session used.
	issuers *ca.Bundle
	// due lists superseded sessions by when their overlap ends.
	due map[*conn]time.Time
	// pruned is the feed position up to which this replica pruned.
	pruned int64
	// registered lists the sessions registered since the last Check
	// (guarded by Service.mu: register appends to it).
	registered []*conn
	// regSeq numbers the registrations (guarded by Service.mu); cut is
	// the last one the running Check may look at in the database: a
	// session registered after its read began may be connected after the
	// read's snapshot, which would show the node held by an earlier
	// session and end the new one as replaced. It is in registered, so
	// the next Check reads it.
	regSeq, cut uint64
	// inRead, when set, runs inside a Check's read after the feed was
	// read (tests: a session registered while a Check reads).
	inRead func()
	// timers holds a deadline per held session (idle or certificate
	// expiry), earliest first.
	timers deadlines
	// buf is reused for the held sessions when every one is checked.
	buf []*conn
	// last describes the last Check (tests and the benchmark).
	last checkStats
}

// checkStats describes one Check.
type checkStats struct {
	swept     bool // every held session was checked against the database
	sweep     int  // sessions of the running sweep checked
	sweepDone bool // the running sweep checked its last slice
	checked   int  // sessions checked against the database
	changes   int  // feed rows read
}

func newHeldState() heldState {
	return heldState{sweepEvery: defaultSweep, due: map[*conn]time.Time{}}
}

// restart forgets the feed position and the due list: the next Check
// sweeps.
func (h *heldState) restart() {
	h.feed.Reset()
	h.issuers = nil
	clear(h.due)
	clear(h.sweepLeft)
	h.sweepLeft = nil
}

// checkHeld is one Check: it ends the held sessions that are over (see
// above). It reports false, with polling cleared, when no session is held:
// the poll then returns.
func (s *Service) checkHeld(ctx context.Context) bool {
	h := &s.held
	s.mu.Lock()
	if len(s.sessions) == 0 {
		h.restart()
		clear(h.registered)
		h.registered = h.registered[:0]
		h.timers = nil
		s.polling = false
		s.mu.Unlock()
		return false
	}
	fresh := slices.DeleteFunc(slices.Clone(h.registered), func(c *conn) bool { return s.sessions[c.nodeID] != c })
	clear(h.registered)
	h.registered = h.registered[:0]
	h.cut = h.regSeq // before the read begins: what it may check
	s.mu.Unlock()
	now := s.cfg.Clock.Now()
	for _, c := range fresh {
		h.timers.add(c, s.idle())
	}
	s.expire(now)
	fresh = slices.DeleteFunc(fresh, func(c *conn) bool { return c.reason() != "" })
	s.checkLive(ctx, fresh, now)
	return true
}

// idle is how long a session may go without a heartbeat.
func (s *Service) idle() time.Duration { return time.Duration(idleBeats) * s.cfg.Heartbeat }

// expire ends the sessions whose deadline passed that are idle (no
// heartbeat for idle()) or whose certificate expired, and puts the others
// back at their next deadline; sessions no longer held are dropped.
func (s *Service) expire(now time.Time) {
	h := &s.held
	var due []*conn
	for len(h.timers) > 0 && h.timers[0].at <= now.UnixMilli() {
		due = append(due, heap.Pop(&h.timers).(deadline).c)
	}
	if len(due) == 0 {
		return
	}
	s.mu.Lock()
	due = slices.DeleteFunc(due, func(c *conn) bool { return s.sessions[c.nodeID] != c })
	s.mu.Unlock()
	idle := s.idle()
	for _, c := range due {
		switch {
		case c.reason() != "":
		case now.Sub(time.UnixMilli(c.lastRecv.Load())) > idle:
			c.end(endIdle, errs.New(errs.Unavailable, "Session idle: no heartbeat"))
		case !now.Before(c.notAfter):
			c.end(endCertExpired, errs.New(errs.Unavailable, "Session ended: the certificate expired; renew and reconnect"))
		default:
			h.timers.add(c, idle)
		}
	}
}

// heldNow returns the sessions held now that have not ended, in a buffer
// the next call reuses.
func (s *Service) heldNow() []*conn {
	h := &s.held
	clear(h.buf)
	all := h.buf[:0]
	s.mu.Lock()
	for _, c := range s.sessions {
		if c.reason() == "" {
			all = append(all, c)
		}
	}
	s.mu.Unlock()
	h.buf = all
	return all
}

// deadline is when a session is looked at next: idle unless it beat
// since, or its certificate expired.
type deadline struct {
	at int64 // unix ms
	c  *conn
}

// deadlines is a min-heap of deadlines (container/heap).
type deadlines []deadline

func (d deadlines) Len() int           { return len(d) }
func (d deadlines) Less(i, j int) bool { return d[i].at < d[j].at }
func (d deadlines) Swap(i, j int)      { d[i], d[j] = d[j], d[i] }
func (d *deadlines) Push(x any)        { *d = append(*d, x.(deadline)) }
func (d *deadlines) Pop() any {
	old := *d
	x := old[len(old)-1]
	old[len(old)-1] = deadline{}
	*d = old[:len(old)-1]
	return x
}

// add schedules c at its next deadline: the first millisecond it is idle
// (more than idle after its last heartbeat) or its certificate's expiry,
// rounded up, so that a session taken off the heap is over or beat since.
func (d *deadlines) add(c *conn, idle time.Duration) {
	at := c.lastRecv.Load() + idle.Milliseconds() + 1
	if na := (c.notAfter.UnixNano() + int64(time.Millisecond) - 1) / int64(time.Millisecond); na < at {
		at = na
	}
	heap.Push(d, deadline{at: at, c: c})
}

// checkLive checks against the database the held sessions the feed, fresh
// (registered since the last Check), the due list and the running sweep
// name, or every held session when the feed cannot be trusted.
func (s *Service) checkLive(ctx context.Context, fresh []*conn, now time.Time) {
	h := &s.held
	h.last = checkStats{}
	sweep := !h.feed.Started() // every held session, now
	begin := !sweep && len(h.sweepLeft) == 0 && now.Sub(h.lastSweep) >= h.sweepEvery
	bundle := s.cfg.Core.Bundle().Now()
	issuersMoved := bundle != h.issuers
	var check []*conn
	var changed []store.SessionState
	err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		if sweep || begin {
			behind, err := h.feed.Behind(ctx, tx)
			if err != nil {
				return err
			}
			if behind {
				if err := h.feed.Start(ctx, tx, now); err != nil {
					return err
				}
				sweep = true
			}
		}
		nodes, complete, err := h.feed.Read(ctx, tx, now)
		if err != nil {
			return err
		}
		h.last.changes = len(nodes)
		if !complete {
			sweep = true
		}
		if h.inRead != nil {
			h.inRead()
		}
		if sweep {
			check = s.heldNow()
		} else {
			check = s.toCheck(fresh, nodes, now, begin)
		}
		// Registered since the read began: the next Check's.
		check = slices.DeleteFunc(check, func(c *conn) bool { return c.regSeq > h.cut })
		held := make([]store.HeldSession, len(check))
		for i, c := range check {
			held[i] = store.HeldSession{NodeID: c.nodeID, SessionID: c.id, Serial: c.serial, Generation: c.generation}
		}
		changed, err = tx.ChangedSessions(ctx, held)
		return err
	})
	if err != nil {
		// The next Check starts the feed over and checks every session.
		s.log.Warn("check held sessions", "sessions", len(check), "err", err)
		h.restart()
		return
	}
	h.last.swept, h.last.checked = sweep, len(check)
	for i, c := range check {
		reason := ""
		if len(changed) > 0 && changed[0].Held == i {
			reason = s.dbReason(c, changed[0], now)
			changed = changed[1:]
		}
		if reason == "" && !s.cfg.Core.IssuerAccepted(c.issuerKeyID, c.issuer) {
			// R21.2: its node CA was retired, which refuses the
			// certificate as a revocation does.
			reason = EndRevoked
		}
		s.endHeld(c, reason)
	}
	if issuersMoved && !sweep {
		// A rotation may have retired a node CA: every session's issuer
		// is checked, in memory, only when the live bundle changed.
		for _, c := range s.heldNow() {
			if !s.cfg.Core.IssuerAccepted(c.issuerKeyID, c.issuer) {
				s.endHeld(c, EndRevoked)
			}
		}
	}
	h.issuers = bundle
	clear(h.buf) // ended sessions are not kept by the buffer
	if sweep {
		h.lastSweep = now
		clear(h.sweepLeft)
		h.sweepLeft = nil
	}
	if sweep || h.last.sweepDone {
		s.pruneFeed(ctx, now)
	}
}

// sweepNext returns the next slice of the running sweep, beginning one
// (every held session, in sweepEvery/Check slices) when begin is set.
func (s *Service) sweepNext(begin bool, now time.Time) []*conn {
	h := &s.held
	if begin {
		h.sweepLeft = slices.Clone(s.heldNow())
		steps := max(1, int(h.sweepEvery/s.cfg.Check))
		h.sweepStep = max(1, (len(h.sweepLeft)+steps-1)/steps)
		h.lastSweep = now
	}
	n := min(h.sweepStep, len(h.sweepLeft))
	next := h.sweepLeft[:n]
	h.sweepLeft = h.sweepLeft[n:]
	h.last.sweep = n
	if len(h.sweepLeft) == 0 {
		h.sweepLeft, h.last.sweepDone = nil, true
	}
	return next
}

// toCheck returns the live sessions to check against the database now:
// fresh ones, those of the nodes the feed named, and the due ones whose
// overlap ended, and the running sweep's next slice, each once.
func (s *Service) toCheck(fresh []*conn, nodes []string, now time.Time, begin bool) []*conn {
	h := &s.held
	check := fresh
	seen := make(map[*conn]bool, len(fresh)+len(nodes))
	for _, c := range fresh {
		seen[c] = true
	}
	add := func(c *conn) {
		if c != nil && !seen[c] && c.reason() == "" {
			seen[c] = true
			check = append(check, c)
		}
	}
	if len(nodes) > 0 {
		s.mu.Lock()
		for _, id := range nodes {
			add(s.sessions[id])
		}
		s.mu.Unlock()
	}
	for c, at := range h.due {
		if !now.Before(at) {
			delete(h.due, c)
			add(c)
		}
	}
	if begin || len(h.sweepLeft) > 0 {
		next := s.sweepNext(begin, now)
		s.mu.Lock()
		for _, c := range next {
			if s.sessions[c.nodeID] == c {
				add(c)
			}
		}
		s.mu.Unlock()
		clear(next) // the slice's pointers: ended sessions are not kept
	}
	return check
}

// endHeld ends c for reason, unless reason is "".
func (s *Service) endHeld(c *conn, reason string) {
	if reason == "" {
		return
	}
	s.log.Info("session ended by the control plane", telemetry.LogNodeID, c.nodeID, "session", c.id, telemetry.LogReason, reason)
	cause := endCause(reason)
	if reason == endReplaced {
		cause = errReplaced
	}
	c.end(reason, cause)
}

// dbReason returns why the database says c is over at now, or "". A
// session superseded by a renewal whose overlap has not ended yet goes on
// the due list, to be checked again when it ends.
func (s *Service) dbReason(c *conn, st store.SessionState, now time.Time) string {
	reason := ended(c, st, now)
	if reason == "" && st.CertSupersededAt != nil {
		s.held.due[c] = st.CertSupersededAt.Add(nodeident.SessionOverlap)
	}
	return reason
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

// pruneFeed deletes the feed rows this replica read past
// store.FeedRetention ago (every reader has read them, or sweeps).
func (s *Service) pruneFeed(ctx context.Context, now time.Time) {
	h := &s.held
	upTo := h.feed.Prunable(now)
	if upTo <= h.pruned {
		return
	}
	err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		_, err := tx.PruneSessionChanges(ctx, upTo)
		return err
	})
	if err != nil {
		s.log.Warn("prune the session change feed", "err", err)
		return
	}
	h.pruned = upTo
}
