package store_test

import (
	"context"
	"errors"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// fixture creates a tenant, a site and a bcd pool.
func fixture(t *testing.T, db *store.DB) (store.Tenant, store.Site, store.Pool) {
	t.Helper()
	ctx := context.Background()
	var tn store.Tenant
	var st store.Site
	var pl store.Pool
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		now := time.Now()
		if tn, err = tx.InsertTenant(ctx, ids.New(ids.Tenant, now), "acme-"+ids.New("x", now)); err != nil {
			return err
		}
		if st, err = tx.InsertSite(ctx, store.Site{ID: ids.New(ids.Site, now), OwnerTenantID: tn.ID, Name: "eu-1", Region: "eu"}); err != nil {
			return err
		}
		pl, err = tx.InsertPool(ctx, store.Pool{ID: ids.New(ids.Pool, now), SiteID: st.ID, OwnerTenantID: tn.ID, Name: "gpu", Agent: "bcd", Policy: []byte(`{}`)})
		return err
	})
	if err != nil {
		t.Fatalf("fixture: %v", err)
	}
	return tn, st, pl
}

func insertToken(t *testing.T, db *store.DB, pl store.Pool, uses int, key string, ttl time.Duration) store.JoinToken {
	t.Helper()
	ctx := context.Background()
	var out store.JoinToken
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		var err error
		out, err = tx.InsertJoinToken(ctx, store.JoinToken{ID: ids.New(ids.JoinToken, time.Now()), TenantID: pl.OwnerTenantID, PoolID: pl.ID, SiteID: pl.SiteID,
			Role: "node", SecretSHA256: make([]byte, 32), MaxUses: uses, Expect: []byte(`{}`), IdempotencyKey: key, CreatedBy: "test"}, ttl)
		return err
	})
	if err != nil {
		t.Fatalf("insert token: %v", err)
	}
	return out
}

func TestComputeNowAndOffset(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		read := func() time.Time {
			var now time.Time
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				now, err = tx.Now(ctx)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			return now
		}
		if d := time.Since(read()); d > 5*time.Second || d < -5*time.Second {
			t.Fatalf("compute_now off wall time by %v", d)
		}
		if err := db.SetClockOffset(ctx, 48*time.Hour); err != nil {
			t.Fatal(err)
		}
		if d := read().Sub(time.Now()); d < 47*time.Hour {
			t.Fatalf("offset not applied: %v", d)
		}
	})
}

// R2.1, R2.5, R2.6: tokens are stored hashed, expire on the database's clock,
// and revocation is idempotent.
func TestJoinTokenLifecycle(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		live := insertToken(t, db, pl, 2, "k1", time.Hour)
		if !live.Live || live.UsesLeft != 2 || live.IdempotencyKey != "k1" {
			t.Fatalf("inserted token = %+v", live)
		}
		short := insertToken(t, db, pl, 1, "", time.Minute)
		revoked := insertToken(t, db, pl, 1, "", time.Hour)

		// Same idempotency key in the tenant: unique violation.
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			_, err := tx.InsertJoinToken(ctx, store.JoinToken{ID: ids.New(ids.JoinToken, time.Now()), TenantID: pl.OwnerTenantID, PoolID: pl.ID, SiteID: pl.SiteID,
				Role: "node", SecretSHA256: make([]byte, 32), MaxUses: 1, Expect: []byte(`{}`), IdempotencyKey: "k1", CreatedBy: "t"}, time.Hour)
			return err
		})
		if !store.IsUniqueViolation(err) {
			t.Fatalf("reused key: err = %v, want unique violation", err)
		}
		err = db.WithTx(ctx, func(tx *store.Tx) error {
			first, err := tx.RevokeJoinToken(ctx, revoked.ID)
			if err != nil || !first {
				return errors.Join(err, errors.New("first revoke did not revoke"))
			}
			again, err := tx.RevokeJoinToken(ctx, revoked.ID)
			if err != nil || again {
				return errors.Join(err, errors.New("second revoke revoked again"))
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := db.SetClockOffset(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		err = db.ReadTx(ctx, func(tx *store.Tx) error {
			liveOnly, err := tx.ListJoinTokens(ctx, pl.ID, false, "", 100)
			if err != nil {
				return err
			}
			if len(liveOnly) != 1 || liveOnly[0].ID != live.ID {
				t.Errorf("live tokens = %v, want only %s", liveOnly, live.ID)
			}
			all, err := tx.ListJoinTokens(ctx, pl.ID, true, "", 100)
			if err != nil {
				return err
			}
			if len(all) != 3 {
				t.Errorf("all tokens = %d, want 3", len(all))
			}
			got, err := tx.GetJoinToken(ctx, short.ID)
			if err != nil {
				return err
			}
			if got.Live {
				t.Errorf("token past expiry on compute_now() is live")
			}
			if _, err := tx.GetJoinToken(ctx, "jt_missing"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("missing token: err = %v", err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// R4.4: concurrent consumers of one token spend exactly its uses. They read
// it without a lock, as the join-token attestor does: the conditional UPDATE
// alone keeps the count exact.
func TestConsumeIsExact(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		tok := insertToken(t, db, pl, 10, "", time.Hour)
		var ok atomic.Int64
		var wg sync.WaitGroup
		for i := 0; i < 40; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				err := db.WithTx(ctx, func(tx *store.Tx) error {
					if _, err := tx.GetJoinTokenForJoin(ctx, tok.ID); err != nil {
						return err
					}
					spent, err := tx.ConsumeJoinTokenUse(ctx, tok.ID)
					if spent {
						ok.Add(1)
					}
					return err
				})
				if err != nil {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
		if ok.Load() != 10 {
			t.Fatalf("consumed %d uses, want 10", ok.Load())
		}
	})
}

// R4.4: admission's read of a token (GetJoinTokenForJoin) carries what
// GetJoinToken does, bar the count: whether a use is left, revocation and
// expiry at compute_now(), through each state and slot after slot.
func TestGetJoinTokenForJoin(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		// Two uses in two slots: after one spend the first slot is empty,
		// the second not.
		tok := insertToken(t, db, pl, 2, "", time.Hour)
		revoked := insertToken(t, db, pl, 1, "", time.Hour)
		short := insertToken(t, db, pl, 1, "", time.Minute)
		usedShort := insertToken(t, db, pl, 1, "", time.Minute)
		check := func(id string, wantUses, wantRevoked, wantExpired bool) {
			t.Helper()
			err := db.ReadTx(ctx, func(tx *store.Tx) error {
				full, err := tx.GetJoinToken(ctx, id)
				if err != nil {
					return err
				}
				got, err := tx.GetJoinTokenForJoin(ctx, id)
				if err != nil {
					return err
				}
				want := store.AdmissionToken{ID: full.ID, TenantID: full.TenantID, PoolID: full.PoolID, SiteID: full.SiteID, Role: full.Role,
					SecretSHA256: full.SecretSHA256, Expect: full.Expect, AllowReclaim: full.AllowReclaim, Hosted: full.Hosted,
					Revoked: wantRevoked, Expired: wantExpired, HasUses: wantUses}
				if !reflect.DeepEqual(got, want) {
					t.Errorf("GetJoinTokenForJoin(%s) = %+v, want %+v", id, got, want)
				}
				if live := !got.Revoked && !got.Expired && got.HasUses; live != full.Live || got.HasUses != (full.UsesLeft > 0) {
					t.Errorf("GetJoinTokenForJoin(%s) = %+v, GetJoinToken says live %v with %d uses", id, got, full.Live, full.UsesLeft)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		spend := func(id string) {
			t.Helper()
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				ok, err := tx.ConsumeJoinTokenUse(ctx, id)
				if err == nil && !ok {
					err = errors.New("no use spent")
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		check(tok.ID, true, false, false)
		spend(tok.ID)
		check(tok.ID, true, false, false)
		spend(tok.ID)
		check(tok.ID, false, false, false)
		if err := db.WithTx(ctx, func(tx *store.Tx) error { _, err := tx.RevokeJoinToken(ctx, revoked.ID); return err }); err != nil {
			t.Fatal(err)
		}
		check(revoked.ID, true, true, false)
		spend(usedShort.ID)
		if err := db.SetClockOffset(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		check(short.ID, true, false, true)
		check(usedShort.ID, false, false, true)
		err := db.ReadTx(ctx, func(tx *store.Tx) error {
			if _, err := tx.GetJoinTokenForJoin(ctx, "jt_missing"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("missing token: err = %v", err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// GetPoolWithSite reads what GetPool and GetSite read, in one statement.
func TestGetPoolWithSite(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, st, pl := fixture(t, db)
		err := db.ReadTx(ctx, func(tx *store.Tx) error {
			wantPool, err := tx.GetPool(ctx, pl.ID)
			if err != nil {
				return err
			}
			wantSite, err := tx.GetSite(ctx, st.ID)
			if err != nil {
				return err
			}
			p, s, err := tx.GetPoolWithSite(ctx, pl.ID)
			if err != nil {
				return err
			}
			if !reflect.DeepEqual(p, wantPool) || !reflect.DeepEqual(s, wantSite) {
				t.Errorf("GetPoolWithSite = %+v, %+v; want %+v, %+v", p, s, wantPool, wantSite)
			}
			if _, _, err := tx.GetPoolWithSite(ctx, "pool_missing"); !errors.Is(err, store.ErrNotFound) {
				t.Errorf("missing pool: err = %v", err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// Statements run again (prepared after their first use on SQLite) give the
// same answers in write and read transactions, rolled-back ones included,
// and Close closes them with the database.
func TestRepeatedStatements(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		_, _, pl := fixture(t, db)
		tok := insertToken(t, db, pl, 100, "", time.Hour)
		boom := errors.New("boom")
		for i := range 5 {
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				if _, err := tx.ConsumeJoinTokenUse(ctx, tok.ID); err != nil {
					return err
				}
				if i%2 == 1 {
					return boom
				}
				return nil
			})
			if err != nil && !errors.Is(err, boom) {
				t.Fatal(err)
			}
			err = db.ReadTx(ctx, func(tx *store.Tx) error {
				got, err := tx.GetJoinToken(ctx, tok.ID)
				if err == nil && got.UsesLeft != 100-(i/2+1) {
					t.Errorf("round %d: usesLeft %d, want %d", i, got.UsesLeft, 100-(i/2+1))
				}
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
		}
		if err := db.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
	})
}

// R14.1: nothing is half-written: an error rolls back every statement.
func TestRollback(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		tn, _, _ := fixture(t, db)
		boom := errors.New("boom")
		err := db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertEvent(ctx, tn.ID, "test.event", "x", []byte(`{}`)); err != nil {
				return err
			}
			if _, err := tx.InsertTenant(ctx, ids.New(ids.Tenant, time.Now()), "rolled-back"); err != nil {
				return err
			}
			return boom
		})
		if !errors.Is(err, boom) {
			t.Fatalf("err = %v", err)
		}
		if err := db.WaitEventsVisible(ctx, tn.ID, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		_ = db.ReadTx(ctx, func(tx *store.Tx) error {
			evs, err := tx.ListEvents(ctx, tn.ID, 0, 0, "", 10)
			if err != nil || len(evs) != 0 {
				t.Errorf("events after rollback = %v, %v", evs, err)
			}
			ts, _ := tx.ListTenants(ctx, "", 100)
			for _, x := range ts {
				if x.Name == "rolled-back" {
					t.Errorf("tenant survived rollback")
				}
			}
			return nil
		})
	})
}

// R14.1: events are per tenant, in order, and a cursor resumes after the
// last one read.
func TestEventsCursor(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		a, _, _ := fixture(t, db)
		b, _, _ := fixture(t, db)
		for i := 0; i < 5; i++ {
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				if err := tx.InsertEvent(ctx, a.ID, "security.join-token.created", "jt", []byte(`{}`)); err != nil {
					return err
				}
				return tx.InsertEvent(ctx, b.ID, "other.event", "x", []byte(`{}`))
			}); err != nil {
				t.Fatal(err)
			}
		}
		var first, rest []store.Event
		if err := db.WaitEventsVisible(ctx, a.ID, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		_ = db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			first, err = tx.ListEvents(ctx, a.ID, 0, 0, "", 2)
			if err != nil {
				t.Fatal(err)
			}
			x, y, _ := store.ParseEventCursor(first[1].Cursor())
			rest, err = tx.ListEvents(ctx, a.ID, x, y, "security.", 100)
			if err != nil {
				t.Fatal(err)
			}
			return nil
		})
		if len(first) != 2 || len(rest) != 3 {
			t.Fatalf("pages = %d + %d, want 2 + 3", len(first), len(rest))
		}
		for _, e := range append(first, rest...) {
			if e.TenantID != a.ID {
				t.Fatalf("event of tenant %s in %s's stream", e.TenantID, a.ID)
			}
		}
		if rest[0].ID <= first[1].ID {
			t.Fatalf("cursor went back: %d after %d", rest[0].ID, first[1].ID)
		}
	})
}

func TestParseEventCursor(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{{"", true}, {"0.12", true}, {"12", false}, {"a.b", false}, {"-1.2", false}} {
		if _, _, ok := store.ParseEventCursor(tc.in); ok != tc.ok {
			t.Errorf("ParseEventCursor(%q) ok = %v", tc.in, ok)
		}
	}
}
