package api_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

var (
	sealedEvent = regexp.MustCompile(`^ev_[A-Za-z0-9_-]{32}$`)
	sealedAudit = regexp.MustCompile(`^au_[A-Za-z0-9_-]{32}$`)
)

// R14.3: with another tenant's joins interleaved, a tenant's event and
// audit ids and cursors are sealed strings that carry no number (so no gap
// to count), they page exactly the tenant's own rows, and neither tenant
// can use the other's cursor: it is refused exactly as a malformed one.
func TestCursorsRevealNoOtherTenant(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		_, start := eventsAfter(t, e.Admin, w.root, "", isEvent("pool.created", w.noAgent.Id))
		var mine []string
		for i := range 3 {
			mine = append(mine, mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id}).Id)
			for range i + 1 {
				mkToken(t, w.acmeAdmin, &bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id})
			}
		}
		evs, end := eventsAfter(t, e.Admin, w.root, start, isEvent("security.join-token.created", mine[2]))
		var subjects []string
		for _, ev := range evs {
			subjects = append(subjects, ev.Subject)
			if ev.Id != ev.Cursor || !sealedEvent.MatchString(ev.Id) {
				t.Fatalf("event id %q cursor %q: want one sealed string", ev.Id, ev.Cursor)
			}
		}
		if !slices.Equal(subjects, mine) {
			t.Fatalf("root's events after start: %v, want its tokens %v", subjects, mine)
		}
		// The store's positions of root's events have gaps (acme's rows);
		// nothing of them is in what root reads.
		assertNoPositions(t, e.DB, w.root, evs)

		t.Run("stable and paged", func(t *testing.T) {
			again, end2 := eventsAfter(t, e.Admin, w.root, start, nil)
			if end2 != end || len(again) != len(evs) {
				t.Fatalf("second read ends at %q with %d events, first at %q with %d", end2, len(again), end, len(evs))
			}
			cur := start
			for i := range evs {
				res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: cur, Limit: 1}))
				mustOK(t, err)
				if len(res.Msg.Events) != 1 || res.Msg.Events[0].Id != evs[i].Id || again[i].Id != evs[i].Id {
					t.Fatalf("page %d: %v, want %s", i, res.Msg.Events, evs[i].Id)
				}
				cur = res.Msg.NextCursor
			}
			if cur != end {
				t.Fatalf("paging ended at %q, the bulk read at %q", cur, end)
			}
		})
		t.Run("foreign cursors", func(t *testing.T) { foreignCursors(t, e, w, end) })
	})
}

// foreignCursors: a cursor of one tenant is refused for the other, by the
// other's admin and by root (who may read both), with the message of a
// malformed cursor.
func foreignCursors(t *testing.T, e *apitest.Env, w *world, rootEnd string) {
	ctx := context.Background()
	malformed := wantErrOf(t, func() error {
		_, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: "nope"}))
		return err
	})
	acmeEvs, acmeEnd := eventsAfter(t, w.acmeAdmin, w.acme, "", nil)
	acmeAudit := auditAll(t, w.acmeAdmin, w.acme)
	rootAudit := auditAll(t, e.Admin, w.root)
	if len(acmeEvs) == 0 || len(acmeAudit) == 0 || len(rootAudit) == 0 {
		t.Fatal("no rows to take cursors from")
	}
	for _, a := range slices.Concat(acmeAudit, rootAudit) {
		if a.Id != a.Cursor || !sealedAudit.MatchString(a.Id) {
			t.Fatalf("audit id %q cursor %q: want one sealed string", a.Id, a.Cursor)
		}
	}
	for _, c := range []struct {
		name   string
		call   func() error
		reader string
	}{
		{"root's event cursor, acme's admin", func() error {
			_, err := w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme, Cursor: rootEnd}))
			return err
		}, w.acme},
		{"root's event cursor on acme, root", func() error {
			_, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme, Cursor: rootEnd}))
			return err
		}, w.acme},
		{"acme's event cursor on root", func() error {
			_, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: acmeEnd}))
			return err
		}, w.root},
		{"acme's audit cursor on root", func() error {
			_, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, Cursor: acmeAudit[0].Cursor}))
			return err
		}, w.root},
		{"root's audit cursor, acme's admin", func() error {
			_, err := w.acmeAdmin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.acme, Cursor: rootAudit[0].Cursor}))
			return err
		}, w.acme},
		{"an audit cursor as an event cursor", func() error {
			_, err := w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme, Cursor: acmeAudit[0].Cursor}))
			return err
		}, w.acme},
		{"an altered cursor", func() error {
			c := []byte(acmeEnd)
			c[5] ^= 1
			_, err := w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme, Cursor: string(c)}))
			return err
		}, w.acme},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := wantErrOf(t, c.call)
			if got.Code != malformed.Code || got.Field != malformed.Field || got.Message != malformed.Message {
				t.Fatalf("refused as %s %s %q; a malformed cursor is %s %s %q", got.Code, got.Field, got.Message, malformed.Code, malformed.Field, malformed.Message)
			}
		})
	}
}

// wantErrOf runs call and returns its INVALID_ARGUMENT on "cursor".
func wantErrOf(t *testing.T, call func() error) *errs.E {
	t.Helper()
	return wantErr(t, call(), errs.InvalidArgument, "cursor")
}

// assertNoPositions checks that the store's positions of the tenant's
// events, which have gaps, appear nowhere in what the API handed out.
func assertNoPositions(t *testing.T, db *store.DB, tenant string, evs []*bcv1.Event) {
	t.Helper()
	var rows []store.Event
	err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListEvents(context.Background(), tenant, 0, 0, "", 10000)
		return err
	})
	mustOK(t, err)
	rows = rows[len(rows)-len(evs):]
	if rows[len(rows)-1].ID-rows[0].ID == int64(len(rows)-1) {
		t.Fatalf("the store's ids %d..%d have no gaps: the test interleaves nothing", rows[0].ID, rows[len(rows)-1].ID)
	}
	for i, r := range rows {
		for _, s := range []string{evs[i].Id, evs[i].Cursor} {
			if _, err := strconv.ParseInt(s, 10, 64); err == nil || s == r.Cursor() {
				t.Fatalf("event %d handed out as %q (position %s)", r.ID, s, r.Cursor())
			}
		}
	}
}

// R14.3: a tenant's long poll answers only with its own events; another
// tenant's event, which answers that tenant's poll, leaves it waiting.
func TestLongPollOnlyOwnEvents(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ctx := context.Background()
		_, rootEnd := eventsAfter(t, e.Admin, w.root, "", isEvent("pool.created", w.noAgent.Id))
		_, acmeEnd := eventsAfter(t, w.acmeAdmin, w.acme, "", isEvent("pool.created", w.acmePool.Id))
		poll := func(c func() (*bcv1.ListEventsResponse, error)) chan *bcv1.ListEventsResponse {
			ch := make(chan *bcv1.ListEventsResponse, 1)
			go func() {
				res, err := c()
				if err != nil {
					t.Error(err)
				}
				ch <- res
			}()
			return ch
		}
		acme := poll(func() (*bcv1.ListEventsResponse, error) {
			res, err := w.acmeAdmin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.acme, Cursor: acmeEnd, WaitSeconds: 25}))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		})
		root := poll(func() (*bcv1.ListEventsResponse, error) {
			res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: rootEnd, WaitSeconds: 25}))
			if err != nil {
				return nil, err
			}
			return res.Msg, nil
		})
		rootTok := mkToken(t, e.Admin, &bcv1.CreateJoinTokenRequest{TenantId: w.root, PoolId: w.pool.Id})
		select {
		case res := <-root:
			if res == nil || len(res.Events) == 0 || res.Events[0].Subject != rootTok.Id {
				t.Fatalf("root's poll = %v", res)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("root's poll did not answer its event")
		}
		select {
		case res := <-acme:
			t.Fatalf("acme's poll answered on root's event: %v", res)
		default:
		}
		acmeTok := mkToken(t, w.acmeAdmin, &bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id})
		select {
		case res := <-acme:
			if res == nil || len(res.Events) != 1 || res.Events[0].Subject != acmeTok.Id {
				t.Fatalf("acme's poll = %v", res)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("acme's poll did not answer its event")
		}
	})
}

// upgradedDB opens a database as the first replica of this version finds
// one an earlier version ran: rows, and no stream key yet (which opens the
// legacy window for decimal cursors).
func upgradedDB(t *testing.T, dialect string) *store.DB {
	t.Helper()
	ctx := context.Background()
	cfg := store.Config{Driver: dialect}
	driver, source := "pgx", ""
	if dialect == "sqlite" {
		cfg.Path = filepath.Join(t.TempDir(), "bc.db")
		driver, source = "sqlite", cfg.Path
	} else {
		cfg.DSN = storetest.PostgresDSN(t)
		source = cfg.DSN
	}
	old, err := store.Open(ctx, cfg, nil)
	mustOK(t, err)
	mustOK(t, old.WithTx(ctx, func(tx *store.Tx) error { return tx.InsertEvent(ctx, "tn_old", "test.event", "s", []byte("{}")) }))
	mustOK(t, old.Close())
	raw, err := sql.Open(driver, source)
	mustOK(t, err)
	_, err = raw.Exec("DELETE FROM stream_key")
	mustOK(t, err)
	mustOK(t, raw.Close())
	db, err := store.Open(ctx, cfg, nil)
	mustOK(t, err)
	t.Cleanup(func() { db.Close() })
	if db.StreamKey().LegacyUntil.IsZero() {
		t.Fatal("no legacy window on a database with rows")
	}
	return db
}

// R14.3, rolling upgrades: a decimal cursor an older replica handed out
// reads on at a new one, which answers with sealed cursors; a decimal
// cursor naming another tenant's row is refused.
func TestDecimalCursorsAfterUpgrade(t *testing.T) {
	for _, dialect := range []string{"sqlite", "postgres"} {
		t.Run(dialect, func(t *testing.T) {
			e := apitest.Start(t, upgradedDB(t, dialect), apitest.Options{NoJoin: true})
			w := newWorld(t, e)
			ctx := context.Background()
			mkToken(t, w.acmeAdmin, &bcv1.CreateJoinTokenRequest{TenantId: w.acme, PoolId: w.acmePool.Id})
			evs, end := eventsAfter(t, e.Admin, w.root, "", isEvent("pool.created", w.noAgent.Id))
			rows := storeEvents(t, e.DB, w.root)
			if len(rows) != len(evs) || len(rows) < 2 {
				t.Fatalf("%d events in the store, %d through the API", len(rows), len(evs))
			}
			res, err := e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: rows[0].Cursor()}))
			mustOK(t, err)
			if len(res.Msg.Events) != len(evs)-1 || res.Msg.Events[0].Id != evs[1].Id || res.Msg.NextCursor != end {
				t.Fatalf("after decimal %s: %d events, next %q; want %d, %q", rows[0].Cursor(), len(res.Msg.Events), res.Msg.NextCursor, len(evs)-1, end)
			}
			last := rows[len(rows)-1].Cursor()
			res, err = e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: last}))
			mustOK(t, err)
			if len(res.Msg.Events) != 0 || res.Msg.NextCursor != end {
				t.Fatalf("at the end, decimal %s: %v, next %q; want none and %q", last, res.Msg.Events, res.Msg.NextCursor, end)
			}
			acmeRows := storeEvents(t, e.DB, w.acme)
			_, err = e.Admin.Events.ListEvents(ctx, rq(&bcv1.ListEventsRequest{TenantId: w.root, Cursor: acmeRows[0].Cursor()}))
			wantErrOf(t, func() error { return err })

			audit := auditAll(t, e.Admin, w.root)
			var first []store.AuditEntry
			mustOK(t, e.DB.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				first, err = tx.ListAuditAfter(ctx, w.root, 0, 1)
				return err
			}))
			ares, err := e.Admin.Events.ListAudit(ctx, rq(&bcv1.ListAuditRequest{TenantId: w.root, Cursor: strconv.FormatInt(first[0].ID, 10)}))
			mustOK(t, err)
			if len(ares.Msg.Items) != len(audit)-1 || ares.Msg.Items[0].Id != audit[1].Id || ares.Msg.NextCursor != audit[len(audit)-1].Cursor {
				t.Fatalf("audit after decimal %d: %d rows; want %d", first[0].ID, len(ares.Msg.Items), len(audit)-1)
			}
		})
	}
}

// storeEvents reads the tenant's events through the store.
func storeEvents(t *testing.T, db *store.DB, tenant string) []store.Event {
	t.Helper()
	mustOK(t, db.WaitEventsVisible(context.Background(), tenant, 10*time.Second))
	var rows []store.Event
	mustOK(t, db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListEvents(context.Background(), tenant, 0, 0, "", 10000)
		return err
	}))
	return rows
}
