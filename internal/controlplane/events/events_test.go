package events_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
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

// R14.3: a tenant's reader is woken by its own tenant's events only. The
// other tenant's reader being woken is the moment its event was handled;
// the first tenant's channel is still open then. Wait wakes on either.
func TestHubWakesOnlyTheTenant(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		hub := events.NewHub()
		publish := func(tenant string) {
			t.Helper()
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				return events.Publish(ctx, tx, hub, events.Event{TenantID: tenant, Type: "test.event", Subject: "s"})
			}); err != nil {
				t.Fatal(err)
			}
		}
		waitClosed := func(ch <-chan struct{}, what string) {
			t.Helper()
			select {
			case <-ch:
			case <-time.After(10 * time.Second):
				t.Fatalf("%s never woke", what)
			}
		}
		a, releaseA := hub.WaitTenant("tn_a")
		defer releaseA()
		a2, releaseA2 := hub.WaitTenant("tn_a")
		defer releaseA2()
		for i := range 5 {
			b, releaseB := hub.WaitTenant("tn_b")
			all := hub.Wait()
			publish("tn_b")
			waitClosed(b, "tn_b's reader")
			waitClosed(all, "Wait")
			releaseB()
			for _, ch := range []<-chan struct{}{a, a2} {
				select {
				case <-ch:
					t.Fatalf("event %d of tn_b woke tn_a's reader", i)
				default:
				}
			}
		}
		publish("tn_a")
		waitClosed(a, "tn_a's reader")
		waitClosed(a2, "tn_a's second reader")
	})
}

// A reader that stops waiting (release) without being woken frees what it
// waited on, and a release after a wake, or twice, does no harm.
func TestHubRelease(t *testing.T) {
	hub := events.NewHub()
	_, r1 := hub.WaitTenant("tn_a")
	_, r2 := hub.WaitTenant("tn_a")
	r1()
	r1()
	if n := events.HubWaiting(hub); n != 1 {
		t.Fatalf("%d tenants waiting after one of two readers left, want 1", n)
	}
	r2()
	if n := events.HubWaiting(hub); n != 0 {
		t.Fatalf("%d tenants waiting after every reader left, want 0", n)
	}
}
