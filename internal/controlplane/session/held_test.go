package session

import (
	"context"
	"crypto/rand"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// replicas runs fn on each dialect with two stores on one database: this
// replica's and another replica's (on SQLite, one process holds the file,
// so both are the one store).
func replicas(t *testing.T, fn func(t *testing.T, mine, other *store.DB)) {
	t.Run("sqlite", func(t *testing.T) {
		db := storetest.OpenSQLite(t)
		fn(t, db, db)
	})
	t.Run("postgres", func(t *testing.T) {
		dbs := storetest.PostgresReplicas(t, 2)
		fn(t, dbs[0], dbs[1])
	})
}

// heldService returns a session service on db with a fake clock and a live
// bundle (a rotation swaps it), that runs no poll: tests run its Checks.
func heldService(tb testing.TB, db *store.DB) (*Service, *clock.Fake, *ca.Live) {
	tb.Helper()
	fc := clock.NewFake(time.UnixMilli(time.Now().UnixMilli()))
	bundle, err := ca.Generate("held.example.com", fc.Now())
	if err != nil {
		tb.Fatal(err)
	}
	live := ca.NewLive(bundle)
	s := New(Config{DB: db, Clock: fc, Bundle: bundle})
	s.polling = true // no poll goroutine: the test runs the Checks
	return s, fc, live
}

// heldFleet stores n adopted nodes of one pool, each with a certificate of
// the service's node CA and connected by a session, and registers those
// sessions in s as Connect does.
func heldFleet(tb testing.TB, s *Service, fc *clock.Fake, n int) []*conn {
	tb.Helper()
	ctx := context.Background()
	db := s.cfg.DB
	now := fc.Now()
	var pl store.Pool
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		tn, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "acme-"+ids.New("x", now))
		if err != nil {
			return err
		}
		st, err := tx.InsertSite(ctx, store.Site{ID: ids.New(ids.Site, now), OwnerTenantID: tn.ID, Name: "eu-1", Region: "eu"})
		if err != nil {
			return err
		}
		pl, err = tx.InsertPool(ctx, store.Pool{ID: ids.New(ids.Pool, now), SiteID: st.ID, OwnerTenantID: tn.ID, Name: "gpu", Agent: "bcd", Policy: []byte(`{}`)})
		return err
	})
	if err != nil {
		tb.Fatal(err)
	}
	issuer := s.cfg.Core.Bundle().Now().TrustedNodeCAs()[0].SubjectKeyId
	conns := make([]*conn, n)
	const batch = 500
	for base := 0; base < n; base += batch {
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			for i := base; i < min(n, base+batch); i++ {
				node, err := tx.InsertNode(ctx, store.Node{ID: ids.New(ids.Node, now), TenantID: pl.OwnerTenantID, SiteID: pl.SiteID, PoolID: pl.ID, Role: "node",
					State: store.NodeAdopted, IdentityGeneration: 1, NodeKey: "unattested", Attestor: "join-token", Claims: []byte(`{}`)})
				if err != nil {
					return err
				}
				serial := make([]byte, 16)
				_, _ = rand.Read(serial)
				c := &conn{id: newSessionID(), nodeID: node.ID, tenantID: node.TenantID, generation: 1, serial: fmt.Sprintf("%x", serial),
					issuerKeyID: issuer, notAfter: now.Add(24 * time.Hour), sent: map[string]struct{}{}}
				c.lastRecv.Store(now.UnixMilli())
				_, c.cancel = context.WithCancelCause(ctx)
				if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: c.serial, NodeID: c.nodeID, IdentityGeneration: 1, Role: pki.RoleNode,
					SPKISHA256: make([]byte, 32), DER: []byte(c.serial), NotBefore: now, NotAfter: c.notAfter, CreatedAt: now}); err != nil {
					return err
				}
				if _, err := tx.ConnectNode(ctx, c.nodeID, c.id); err != nil {
					return err
				}
				conns[i] = c
			}
			return nil
		})
		if err != nil {
			tb.Fatal(err)
		}
	}
	for _, c := range conns {
		s.register(c)
	}
	return conns
}

// beat records a heartbeat of every session at the clock's time.
func beat(fc *clock.Fake, conns []*conn) {
	for _, c := range conns {
		c.lastRecv.Store(fc.Now().UnixMilli())
	}
}

// change runs fn in a write transaction of db (another replica's store).
func change(t *testing.T, db *store.DB, fn func(ctx context.Context, tx *store.Tx) error) {
	t.Helper()
	ctx := context.Background()
	if err := db.WithTx(ctx, func(tx *store.Tx) error { return fn(ctx, tx) }); err != nil {
		t.Fatal(err)
	}
}

// R12.1: every reason the database gives to end a session, written by
// another replica, ends the session held here at the next Check, which
// checks against the database only the session the change names (no
// sweep); the other sessions go on.
func TestCheckEndsChangedSessions(t *testing.T) {
	replicas(t, func(t *testing.T, mine, other *store.DB) {
		s, fc, live := heldService(t, mine)
		s.held.sweepEvery = 24 * time.Hour
		conns := heldFleet(t, s, fc, 12)
		ctx := context.Background()
		if !s.checkHeld(ctx) || !s.held.last.swept {
			t.Fatalf("the first Check did not sweep: %+v", s.held.last)
		}
		for _, c := range conns {
			if c.reason() != "" {
				t.Fatalf("a live session ended: %s", c.reason())
			}
		}
		cases := []struct {
			name string
			// change makes the change to node c as another replica
			// would; it returns how long the clock moves before the
			// Check that must end the session.
			change func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error)
			want   string
		}{
			{"retired", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				if err := tx.SetNodeState(ctx, c.nodeID, store.NodeRetired, "test"); err != nil {
					return 0, err
				}
				_, err := tx.RevokeAllNodeCerts(ctx, c.nodeID, "retired")
				return 0, err
			}, EndRetired},
			{"reclaimed", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				n, err := tx.GetNode(ctx, c.nodeID)
				if err != nil {
					return 0, err
				}
				if _, err := tx.ReclaimNode(ctx, n, 1); err != nil {
					return 0, err
				}
				_, err = tx.RevokeNodeCerts(ctx, c.nodeID, 2, "reclaimed")
				return 0, err
			}, EndReclaimed},
			{"certificate revoked", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				_, err := tx.RevokeNodeCert(ctx, c.serial, "test")
				return 0, err
			}, EndRevoked},
			{"replaced by a session on another replica", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				_, err := tx.ConnectNode(ctx, c.nodeID, newSessionID())
				return 0, err
			}, endReplaced},
			{"superseded longer than the overlap ago", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				_, err := tx.SupersedeNodeCert(ctx, c.serial, fc.Now().Add(-nodeident.SessionOverlap))
				return 0, err
			}, endSuperseded},
			{"superseded now: ends when the overlap does", func(ctx context.Context, tx *store.Tx, c *conn) (time.Duration, error) {
				_, err := tx.SupersedeNodeCert(ctx, c.serial, fc.Now())
				return nodeident.SessionOverlap, err
			}, endSuperseded},
		}
		for i, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				c := conns[i]
				var wait time.Duration
				change(t, other, func(ctx context.Context, tx *store.Tx) error {
					var err error
					wait, err = tc.change(ctx, tx, c)
					return err
				})
				// The clock moves a minute a Check (a replica checks
				// twice a second).
				for ; wait > 0; wait -= min(wait, time.Minute) {
					s.checkHeld(ctx)
					if got := c.reason(); got != "" {
						t.Fatalf("ended %q within the overlap", got)
					}
					fc.Advance(min(wait, time.Minute))
					beat(fc, conns)
				}
				s.checkHeld(ctx)
				if got := c.reason(); got != tc.want {
					t.Errorf("reason %q, want %q", got, tc.want)
				}
				if st := s.held.last; st.swept || st.checked != 1 {
					t.Errorf("the Check swept or checked more than the changed session: %+v", st)
				}
				for _, o := range conns[len(cases):] {
					if o.reason() != "" {
						t.Fatalf("an unchanged session ended: %s", o.reason())
					}
				}
			})
		}
		// R21.2: a rotation retiring the node CA ends every session it
		// issued, at the next Check, in memory.
		t.Run("node CA retired", func(t *testing.T) {
			next, err := ca.Generate("held.example.com", fc.Now())
			if err != nil {
				t.Fatal(err)
			}
			live.Set(next)
			s.checkHeld(ctx)
			for _, c := range conns[len(cases):] {
				if c.reason() != EndRevoked {
					t.Errorf("reason %q, want %q", c.reason(), EndRevoked)
				}
			}
			if s.held.last.swept {
				t.Errorf("the Check swept: %+v", s.held.last)
			}
		})
	})
}

// A session registered after the feed named its node (its authentication
// read the node before the change) is checked at its first Check.
func TestCheckNewSessionAfterChange(t *testing.T) {
	replicas(t, func(t *testing.T, mine, other *store.DB) {
		s, fc, _ := heldService(t, mine)
		s.held.sweepEvery = 24 * time.Hour
		conns := heldFleet(t, s, fc, 2)
		ctx := context.Background()
		late := conns[1]
		s.mu.Lock()
		delete(s.sessions, late.nodeID)
		s.held.registered = s.held.registered[:1]
		s.mu.Unlock()
		s.checkHeld(ctx) // the sweep, without late
		change(t, other, func(ctx context.Context, tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(ctx, late.serial, "test")
			return err
		})
		s.checkHeld(ctx) // reads the change; late is not held yet
		s.register(late)
		s.checkHeld(ctx)
		if got := late.reason(); got != EndRevoked {
			t.Errorf("reason %q, want %q", got, EndRevoked)
		}
		if st := s.held.last; st.swept || st.checked != 1 {
			t.Errorf("the Check swept or checked more than the new session: %+v", st)
		}
	})
}

// R12.1: a node that reconnects while a Check reads (its new session
// connected after the read's snapshot began) is not ended as replaced by
// what that snapshot shows: the next Check reads it.
func TestCheckSessionRegisteredDuringRead(t *testing.T) {
	replicas(t, func(t *testing.T, mine, other *store.DB) {
		s, fc, _ := heldService(t, mine)
		old := heldFleet(t, s, fc, 1)[0]
		ctx := context.Background()
		fresh := &conn{id: newSessionID(), nodeID: old.nodeID, tenantID: old.tenantID, generation: 1, serial: old.serial,
			issuerKeyID: old.issuerKeyID, notAfter: old.notAfter, sent: map[string]struct{}{}}
		fresh.lastRecv.Store(fc.Now().UnixMilli())
		_, fresh.cancel = context.WithCancelCause(ctx)
		for _, sweep := range []bool{true, false} {
			s.held.inRead = func() {
				s.held.inRead = nil
				change(t, other, func(ctx context.Context, tx *store.Tx) error {
					_, err := tx.ConnectNode(ctx, fresh.nodeID, fresh.id)
					return err
				})
				s.register(fresh)
			}
			s.checkHeld(ctx)
			if st := s.held.last; st.swept != sweep {
				t.Fatalf("swept %v, want %v", st.swept, sweep)
			}
			if got := fresh.reason(); got != "" {
				t.Fatalf("the reconnected session ended: %q", got)
			}
			s.checkHeld(ctx) // reads it
			if got := fresh.reason(); got != "" {
				t.Fatalf("the reconnected session ended at the next Check: %q", got)
			}
			if got, want := old.reason(), endReplaced; got != want {
				t.Errorf("the earlier session: reason %q, want %q", got, want)
			}
			// Again, with the feed running: the node's change is read
			// during the Check.
			old = fresh
			fresh = &conn{id: newSessionID(), nodeID: old.nodeID, tenantID: old.tenantID, generation: 1, serial: old.serial,
				issuerKeyID: old.issuerKeyID, notAfter: old.notAfter, sent: map[string]struct{}{}}
			fresh.lastRecv.Store(fc.Now().UnixMilli())
			_, fresh.cancel = context.WithCancelCause(ctx)
		}
	})
}

// R12.1 on PostgreSQL: a change whose transaction took its feed position
// before another's but commits after this replica read the other one is
// still noticed at the Check after its commit, without a sweep.
func TestCheckCommitOrder(t *testing.T) {
	db, raw := storetest.PostgresWithRaw(t)
	s, fc, _ := heldService(t, db)
	s.held.sweepEvery = 24 * time.Hour
	conns := heldFleet(t, s, fc, 3)
	ctx := context.Background()
	s.checkHeld(ctx)
	slow, fast := conns[0], conns[1]
	tx, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, "UPDATE nodes SET state = 'retired' WHERE id = $1", slow.nodeID); err != nil {
		t.Fatal(err)
	}
	change(t, db, func(ctx context.Context, tx *store.Tx) error {
		return tx.SetNodeState(ctx, fast.nodeID, store.NodeRetired, "test")
	})
	s.checkHeld(ctx)
	if fast.reason() != EndRetired || slow.reason() != "" {
		t.Fatalf("before the slow commit: fast %q, slow %q; want %q and none", fast.reason(), slow.reason(), EndRetired)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	fc.Advance(store.FeedGapWait / 2)
	beat(fc, conns)
	s.checkHeld(ctx)
	if got := slow.reason(); got != EndRetired {
		t.Errorf("slow commit: reason %q, want %q", got, EndRetired)
	}
	if st := s.held.last; st.swept || st.checked != 1 {
		t.Errorf("the Check swept or checked more than the late change's session: %+v", st)
	}
}

// A change the feed did not deliver ends its session at the next sweep
// (every sweepEvery); a replica's first Check sweeps, so a change made
// before it started is noticed at once.
func TestCheckSweep(t *testing.T) {
	replicas(t, func(t *testing.T, mine, other *store.DB) {
		s, fc, _ := heldService(t, mine)
		conns := heldFleet(t, s, fc, 3)
		ctx := context.Background()
		change(t, other, func(ctx context.Context, tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(ctx, conns[0].serial, "test")
			return err
		})
		s.checkHeld(ctx)
		if got := conns[0].reason(); got != EndRevoked || !s.held.last.swept {
			t.Fatalf("first Check: reason %q, swept %v; want %q by a sweep", got, s.held.last.swept, EndRevoked)
		}
		missed := conns[1]
		change(t, other, func(ctx context.Context, tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(ctx, missed.serial, "test")
			return err
		})
		// The feed's rows are read elsewhere: this replica never sees them.
		if err := mine.ReadTx(ctx, func(tx *store.Tx) error {
			_, _, err := s.held.feed.Read(ctx, tx, fc.Now())
			return err
		}); err != nil {
			t.Fatal(err)
		}
		s.checkHeld(ctx)
		if got := missed.reason(); got != "" || s.held.last.swept {
			t.Fatalf("Check without the feed's row: reason %q, swept %v", got, s.held.last.swept)
		}
		// The next sweep begins after defaultSweep, and checks a slice of
		// the held sessions a Check, all within defaultSweep.
		fc.Advance(defaultSweep)
		var took time.Duration
		for ; missed.reason() == "" && took <= defaultSweep; took += s.cfg.Check {
			beat(fc, conns)
			s.checkHeld(ctx)
			if s.held.last.swept || s.held.last.checked > 1 {
				t.Fatalf("a Check of the spread sweep: %+v", s.held.last)
			}
			fc.Advance(s.cfg.Check)
		}
		if got := missed.reason(); got != EndRevoked {
			t.Errorf("after %s and %s of sweep: reason %q, want %q", defaultSweep, took, got, EndRevoked)
		}
		if conns[2].reason() != "" {
			t.Errorf("a live session ended: %s", conns[2].reason())
		}
	})
}

// The feed's rows are pruned once every reader is done with them: the
// sweep after store.FeedRetention deletes what this replica read before.
func TestCheckPrunesFeed(t *testing.T) {
	replicas(t, func(t *testing.T, mine, other *store.DB) {
		s, fc, _ := heldService(t, mine)
		conns := heldFleet(t, s, fc, 3)
		ctx := context.Background()
		s.checkHeld(ctx)
		change(t, other, func(ctx context.Context, tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(ctx, conns[0].serial, "test")
			return err
		})
		s.checkHeld(ctx)
		var before int64
		if err := mine.ReadTx(ctx, func(tx *store.Tx) (err error) { before, err = tx.OldestSessionChange(ctx); return err }); err != nil {
			t.Fatal(err)
		}
		fc.Advance(store.FeedRetention + time.Minute)
		beat(fc, conns)
		change(t, other, func(ctx context.Context, tx *store.Tx) error {
			_, err := tx.RevokeNodeCert(ctx, conns[1].serial, "test")
			return err
		})
		s.checkHeld(ctx)
		if !s.held.last.swept {
			t.Errorf("no sweep after %s: %+v", store.FeedRetention, s.held.last)
		}
		var after int64
		if err := mine.ReadTx(ctx, func(tx *store.Tx) (err error) { after, err = tx.OldestSessionChange(ctx); return err }); err != nil {
			t.Fatal(err)
		}
		if before == 0 || after <= before {
			t.Errorf("oldest feed row %d before, %d after the retention; want it pruned", before, after)
		}
		if conns[1].reason() != EndRevoked {
			t.Errorf("reason %q, want %q", conns[1].reason(), EndRevoked)
		}
	})
}

// Idle sessions and expired certificates end at the first Check after
// their deadline, each session looked at only when its deadline passed; a
// session that beats stays.
func TestCheckIdleAndExpiry(t *testing.T) {
	s, fc, _ := heldService(t, storetest.OpenSQLite(t))
	conns := heldFleet(t, s, fc, 3)
	beating, silent, expiring := conns[0], conns[1], conns[2]
	expiring.notAfter = fc.Now().Add(20 * time.Second)
	ctx := context.Background()
	s.checkHeld(ctx)
	steps := []struct {
		advance time.Duration
		ended   map[*conn]string
	}{
		{19 * time.Second, map[*conn]string{}},
		{time.Second, map[*conn]string{expiring: endCertExpired}},
		{25 * time.Second, map[*conn]string{expiring: endCertExpired}}, // silent for exactly the idle time: not yet
		{time.Millisecond, map[*conn]string{expiring: endCertExpired, silent: endIdle}},
		{time.Hour, map[*conn]string{expiring: endCertExpired, silent: endIdle}},
	}
	for i, st := range steps {
		fc.Advance(st.advance)
		beat(fc, []*conn{beating, expiring})
		s.checkHeld(ctx)
		for _, c := range conns {
			if got := c.reason(); got != st.ended[c] {
				t.Errorf("step %d: session of %s ended %q, want %q", i, c.nodeID, got, st.ended[c])
			}
		}
	}
	// The ended sessions left the deadlines once due (the finished
	// sessions of a real replica leave s.sessions first).
	s.mu.Lock()
	delete(s.sessions, silent.nodeID)
	delete(s.sessions, expiring.nodeID)
	s.mu.Unlock()
	fc.Advance(time.Hour)
	beat(fc, []*conn{beating})
	s.checkHeld(ctx)
	if n := len(s.held.timers); n != 1 || beating.reason() != "" {
		t.Errorf("deadlines %d, beating session %q; want 1 and live", n, beating.reason())
	}
}
