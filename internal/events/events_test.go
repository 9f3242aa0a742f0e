package events_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/events"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/store/storetest"
)

// R14.1: the Hub wakes a long-poll reader only once the published event can
// be read, so the reader's one read after waking finds it (on PostgreSQL
// the event is numbered by the sequencer after the commit).
func TestHubWakesWhenReadable(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		hub := events.NewHub()
		for i := range 20 {
			wake := hub.Wait()
			subject := "s" + string(rune('a'+i))
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				return events.Publish(ctx, tx, hub, events.Event{TenantID: "tn_hub", Type: "test.event", Subject: subject, Data: map[string]any{"i": i}})
			})
			if err != nil {
				t.Fatal(err)
			}
			select {
			case <-wake:
			case <-time.After(10 * time.Second):
				t.Fatalf("event %d: the hub never woke", i)
			}
			var evs []store.Event
			if err := db.ReadTx(ctx, func(tx *store.Tx) error {
				var err error
				evs, err = tx.ListEvents(ctx, "tn_hub", 0, 0, "", 100)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if len(evs) != i+1 || evs[i].Subject != subject || string(evs[i].Data) != fmt.Sprintf(`{"i":%d}`, i) {
				t.Fatalf("after waking for event %d the stream is %+v", i, evs)
			}
		}
	})
}

// The Hub's wake waits for the sequencer on PostgreSQL. The test holds the
// sequencer's lock while it publishes: had the hub woken at the commit, a
// read at that moment could not find the event. Whenever the wake is seen,
// a read finds the event.
func TestHubWaitsForSequencer(t *testing.T) {
	ctx := context.Background()
	db, raw := storetest.PostgresWithRaw(t)
	lock, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback()
	if _, err := lock.ExecContext(ctx, "SELECT last FROM event_sequencer WHERE id = 1 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	hub := events.NewHub()
	wake := hub.Wait()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return events.Publish(ctx, tx, hub, events.Event{TenantID: "tn_hub", Type: "test.event", Subject: "held"})
	}); err != nil {
		t.Fatal(err)
	}
	readable := func() bool {
		var evs []store.Event
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			evs, err = tx.ListEvents(ctx, "tn_hub", 0, 0, "", 10)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return len(evs) == 1 && evs[0].Subject == "held"
	}
	select {
	case <-wake:
		if !readable() {
			t.Fatal("the hub woke before the event could be read")
		}
	default:
	}
	if err := lock.Rollback(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-wake:
	case <-time.After(10 * time.Second):
		t.Fatal("the hub never woke")
	}
	if !readable() {
		t.Fatal("woken, but the event cannot be read")
	}
}
