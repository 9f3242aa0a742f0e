package events_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

func testCodec(t *testing.T, legacyUntil time.Time) *events.Codec {
	t.Helper()
	c, err := events.NewCodec(store.StreamKey{Key: bytes.Repeat([]byte{7}, 32), LegacyUntil: legacyUntil})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// wantCursorRefused checks the one refusal every bad cursor gets.
func wantCursorRefused(t *testing.T, err error) {
	t.Helper()
	e, ok := errs.As(err)
	if !ok || e.Code != errs.InvalidArgument || e.Field != "cursor" || e.Message != "cursor: not a cursor from this API" {
		t.Fatalf("err = %v, want INVALID_ARGUMENT cursor: not a cursor from this API", err)
	}
}

// R14.3: a sealed cursor opens only for its tenant and kind; everything
// else, another tenant's, altered, cut, or of the other kind, is refused
// the same way as nonsense. The sealed cursors need no database.
func TestCodecOpensOnlyItsOwn(t *testing.T) {
	ctx := context.Background()
	c := testCodec(t, time.Time{})
	ev := c.EventCursor("tn_a", 41, 97)
	au := c.AuditCursor("tn_a", 97)
	flip := func(s string, i int) string {
		b := []byte(s)
		b[i] ^= 1
		return string(b)
	}
	for _, tc := range []struct {
		name, tenant, cursor string
		audit, ok            bool
	}{
		{"event, own", "tn_a", ev, false, true},
		{"audit, own", "tn_a", au, true, true},
		{"event, other tenant", "tn_b", ev, false, false},
		{"audit, other tenant", "tn_b", au, true, false},
		{"audit cursor as event", "tn_a", au, false, false},
		{"event cursor as audit", "tn_a", ev, true, false},
		{"event prefix on audit body", "tn_a", "ev_" + au[3:], false, false},
		{"altered body", "tn_a", flip(ev, 4), false, false},
		{"altered tag", "tn_a", flip(ev, len(ev)-2), false, false},
		{"cut", "tn_a", ev[:len(ev)-1], false, false},
		{"padded", "tn_a", ev + "=", false, false},
		{"nonsense", "tn_a", "nope", false, false},
		{"decimal, no legacy window", "tn_a", "41.97", false, false},
		{"decimal audit, no legacy window", "tn_a", "97", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			var got int64
			if tc.audit {
				got, err = c.AuditPosition(ctx, nil, tc.tenant, tc.cursor)
			} else {
				var txo int64
				txo, got, err = c.EventPosition(ctx, nil, tc.tenant, tc.cursor)
				if err == nil && txo != 41 {
					t.Fatalf("tx order %d, want 41", txo)
				}
			}
			if !tc.ok {
				wantCursorRefused(t, err)
				return
			}
			if err != nil || got != 97 {
				t.Fatalf("position %d, %v; want 97", got, err)
			}
		})
	}
}

// R14.3: the sealed strings of consecutive positions are unrelated: in
// their order, as strings and as numbers, about as many neighbours go up as
// down, and no two share a prefix beyond chance, so a tenant cannot order
// them or count what lies between. (The key is fixed: the test is
// deterministic.)
func TestCodecHidesOrder(t *testing.T) {
	c := testCodec(t, time.Time{})
	const n = 2000
	up, shared := 0, 0
	prev := ""
	for i := range int64(n) {
		s := c.EventCursor("tn_a", 0, i+1)
		raw, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(s, "ev_"))
		if err != nil || len(raw) != 24 {
			t.Fatalf("%q: %v", s, err)
		}
		if prev != "" {
			if s > prev {
				up++
			}
			if s[:6] == prev[:6] {
				shared++
			}
		}
		prev = s
	}
	if up < n*4/10 || up > n*6/10 || shared > 2 {
		t.Fatalf("%d of %d neighbours ascend, %d share 3 characters: the strings show the order", up, n-1, shared)
	}
}

// legacyEvent publishes an event of tenant and returns its position as an
// earlier version's decimal cursor.
func legacyEvent(t *testing.T, db *store.DB, tenant string) string {
	t.Helper()
	ctx := context.Background()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return events.Publish(ctx, tx, nil, events.Event{TenantID: tenant, Type: "test.event", Subject: "s"})
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.WaitEventsVisible(ctx, tenant, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	var evs []store.Event
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		evs, err = tx.ListEvents(ctx, tenant, 0, 0, "", 1000)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return evs[len(evs)-1].Cursor()
}

// R14.3, upgrades: a decimal cursor of an earlier version is honoured only
// while the legacy window covers the row it names, and only when it names,
// exactly, a row of the caller's tenant; anything else is refused like a
// malformed cursor, so decimal cursors cannot search the global numbering.
func TestLegacyCursors(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		if !db.StreamKey().LegacyUntil.IsZero() {
			t.Fatal("a database that started new has a legacy window")
		}
		a := legacyEvent(t, db, "tn_a")
		b := legacyEvent(t, db, "tn_b")
		aAudit := legacyAudit(t, db, "tn_a")
		open := testCodec(t, time.Now().Add(time.Hour))
		closed := testCodec(t, time.Now().Add(-time.Hour))
		txo, id, _ := store.ParseEventCursor(a)
		for _, tc := range []struct {
			name   string
			codec  *events.Codec
			tenant string
			cursor string
			audit  bool
			ok     bool
		}{
			{"own event, window open", open, "tn_a", a, false, true},
			{"own audit row, window open", open, "tn_a", aAudit, true, true},
			{"another tenant's event", open, "tn_a", b, false, false},
			{"another tenant's audit row", open, "tn_b", aAudit, true, false},
			{"no such event", open, "tn_a", store.EventCursor(txo, id+1000), false, false},
			{"a position between", open, "tn_a", store.EventCursor(txo, id-1), false, false},
			{"row written after the window", closed, "tn_a", a, false, false},
			{"audit row after the window", closed, "tn_a", aAudit, true, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				var err error
				if tc.audit {
					_, err = tc.codec.AuditPosition(ctx, db, tc.tenant, tc.cursor)
				} else {
					var x, y int64
					x, y, err = tc.codec.EventPosition(ctx, db, tc.tenant, tc.cursor)
					if err == nil && (x != txo || y != id) {
						t.Fatalf("position %d.%d, want %s", x, y, a)
					}
				}
				if !tc.ok {
					wantCursorRefused(t, err)
				} else if err != nil {
					t.Fatal(err)
				}
			})
		}
	})
}

// legacyAudit writes an audit row of tenant and returns its decimal id.
func legacyAudit(t *testing.T, db *store.DB, tenant string) string {
	t.Helper()
	ctx := context.Background()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return events.Audit(ctx, tx, events.Entry{TenantID: tenant, Actor: "system", Action: "test.done", Resource: "x/y"})
	}); err != nil {
		t.Fatal(err)
	}
	var rows []store.AuditEntry
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		rows, err = tx.ListAuditAfter(ctx, tenant, 0, 1000)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return strconv.FormatInt(rows[len(rows)-1].ID, 10)
}

// What sealing adds to reading a row (one AES block and one HMAC) and to
// opening a cursor.
func BenchmarkEventCursor(b *testing.B) {
	c, err := events.NewCodec(store.StreamKey{Key: bytes.Repeat([]byte{7}, 32)})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("seal", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_ = c.EventCursor("tn_01k5w0000000000000000000aa", 41, int64(i))
		}
	})
	s := c.EventCursor("tn_01k5w0000000000000000000aa", 41, 97)
	b.Run("open", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, _, err := c.EventPosition(context.Background(), nil, "tn_01k5w0000000000000000000aa", s); err != nil {
				b.Fatal(err)
			}
		}
	})
}
