package store_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// publish commits one event.
func publish(t *testing.T, db *store.DB, tenant, subject string) {
	t.Helper()
	ctx := context.Background()
	if err := db.WithTx(ctx, func(tx *store.Tx) error {
		return tx.InsertEvent(ctx, tenant, "test.event", subject, []byte(`{}`))
	}); err != nil {
		t.Fatalf("publish %s: %v", subject, err)
	}
}

// waitEvent polls the tenant's stream until subject is in it, failing after
// within.
func waitEvent(t *testing.T, db *store.DB, tenant, subject string, within time.Duration) time.Duration {
	t.Helper()
	ctx := context.Background()
	start := time.Now()
	for {
		var evs []store.Event
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			evs, err = tx.ListEvents(ctx, tenant, 0, 0, "", 1000)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		for _, e := range evs {
			if e.Subject == subject {
				return time.Since(start)
			}
		}
		if time.Since(start) > within {
			t.Fatalf("event %s not readable within %v (%d events readable)", subject, within, len(evs))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// holdWriteTx begins a transaction on dsn that has a transaction id (it
// holds back the cluster's snapshot horizon) and keeps it open until the
// test ends. It returns that transaction id.
func holdWriteTx(t *testing.T, dsn string) int64 {
	t.Helper()
	ctx := context.Background()
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatalf("begin on %s: %v", dsn, err)
	}
	var xid int64
	if err := tx.QueryRowContext(ctx, "SELECT pg_current_xact_id()::TEXT::BIGINT").Scan(&xid); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tx.Rollback()
		db.Close()
	})
	return xid
}

// R14.1: no foreign transaction holds a tenant's stream back. Transactions
// holding a transaction id stay open in another database of the cluster and
// in another schema of this one (the old design hid every event newer than
// the oldest of them: `events list --follow` stalled for as long as they
// ran); an event published meanwhile is readable within a second.
func TestEventsNotStalledByForeignTransactions(t *testing.T) {
	db := storetest.OpenPostgres(t)
	foreignDB := holdWriteTx(t, storetest.ScratchDatabase(t))
	foreignSchema := holdWriteTx(t, storetest.PostgresDSN(t))

	// The horizon the old readers used is held back by them: without that
	// this test would prove nothing.
	ctx := context.Background()
	var horizon int64
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		horizon, err = tx.QueryInt(ctx, "SELECT pg_snapshot_xmin(pg_current_snapshot())::TEXT::BIGINT")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if horizon > foreignDB || horizon > foreignSchema {
		t.Fatalf("the cluster's horizon %d is past the held transactions %d, %d", horizon, foreignDB, foreignSchema)
	}

	publish(t, db, "tn_stall", "during-foreign")
	took := waitEvent(t, db, "tn_stall", "during-foreign", time.Second)
	t.Logf("readable after %v with foreign transactions open", took)
}

// An event committed by a process that died before its sequencer ran (here
// written behind the store's back, as an older replica would) is numbered by
// the sweep of a surviving process.
func TestSequencerSweepsEventsOfDeadWriters(t *testing.T) {
	ctx := context.Background()
	db, raw := storetest.PostgresWithRaw(t)
	if _, err := raw.ExecContext(ctx, "INSERT INTO events (tenant_id, type, subject, data, created_ms) VALUES ('tn_dead', 'test.event', 'orphan', '{}', 0)"); err != nil {
		t.Fatal(err)
	}
	waitEvent(t, db, "tn_dead", "orphan", 5*time.Second)
	// Later events come after it.
	publish(t, db, "tn_dead", "later")
	waitEvent(t, db, "tn_dead", "later", 5*time.Second)
	var evs []store.Event
	_ = db.ReadTx(ctx, func(tx *store.Tx) (err error) {
		evs, err = tx.ListEvents(ctx, "tn_dead", 0, 0, "", 10)
		return err
	})
	if len(evs) != 2 || evs[0].Subject != "orphan" || evs[1].Subject != "later" {
		t.Fatalf("stream = %+v, want orphan then later", evs)
	}
}

// committedTx is what a publisher knows it committed: per tenant, the
// subjects in the order written.
type committedTx struct {
	publisher, seq int
	subjects       map[string][]string
}

// R14.1: many publishers write events concurrently (to several tenants per
// transaction, some transactions rolled back) while readers page through
// each tenant's stream with the cursor. Every reader sees every committed
// event exactly once and nothing rolled back; cursors only move forward; a
// transaction's events are together and in the order written; and a
// publisher's earlier transaction comes before its later ones (it
// committed before the later one began).
func TestEventsExactlyOnceInOrder(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		exactlyOnceInOrder(t, []*store.DB{db})
	})
}

// The same with two API replicas publishing to one PostgreSQL (each runs
// its own sequencer; their passes take turns), on a database whose
// defaults are not PostgreSQL's: repeatable read and asynchronous commit.
func TestEventsExactlyOnceInOrderTwoReplicas(t *testing.T) {
	dsn := storetest.PostgresDSN(t) + "&default_transaction_isolation=repeatable%20read&synchronous_commit=off"
	var dbs []*store.DB
	for range 2 {
		db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: dsn, MaxConns: 8}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		dbs = append(dbs, db)
	}
	exactlyOnceInOrder(t, dbs)
}

// exactlyOnceInOrder publishes through each of dbs in turn and reads
// through the first.
func exactlyOnceInOrder(t *testing.T, dbs []*store.DB) {
	db := dbs[0]
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	ctx := context.Background()
	tenants := []string{"tn_a", "tn_b", "tn_c"}
	const publishers, txsEach, readersPerTenant = 6, 25, 2

	var mu sync.Mutex
	var committed []committedTx
	var pubs sync.WaitGroup
	done := make(chan struct{})
	for p := range publishers {
		pubs.Add(1)
		go func() {
			defer pubs.Done()
			rng := rand.New(rand.NewPCG(uint64(seed), uint64(p)))
			for s := range txsEach {
				c := committedTx{publisher: p, seq: s, subjects: map[string][]string{}}
				n := 1 + rng.IntN(4)
				fail := rng.IntN(5) == 0
				err := dbs[(p+s)%len(dbs)].WithTx(ctx, func(tx *store.Tx) error {
					c.subjects = map[string][]string{}
					for i := range n {
						tn := tenants[rng.IntN(len(tenants))]
						sub := fmt.Sprintf("p%d.s%d.e%d", p, s, i)
						if err := tx.InsertEvent(ctx, tn, "test.event", sub, []byte(`{}`)); err != nil {
							return err
						}
						c.subjects[tn] = append(c.subjects[tn], sub)
					}
					if fail {
						return fmt.Errorf("rolled back on purpose")
					}
					return nil
				})
				if err != nil && !fail {
					t.Errorf("publisher %d tx %d: %v", p, s, err)
				}
				if err == nil {
					mu.Lock()
					committed = append(committed, c)
					mu.Unlock()
				}
			}
		}()
	}
	go func() { pubs.Wait(); close(done) }()

	type read struct {
		tenant string
		events []store.Event
	}
	reads := make(chan read, len(tenants)*readersPerTenant)
	var readers sync.WaitGroup
	for _, tn := range tenants {
		for r := range readersPerTenant {
			readers.Add(1)
			go func() {
				defer readers.Done()
				rng := rand.New(rand.NewPCG(uint64(seed), uint64(1000+r)))
				var got []store.Event
				var atx, aid int64
				page := func() int {
					var evs []store.Event
					if err := db.ReadTx(ctx, func(tx *store.Tx) error {
						var err error
						evs, err = tx.ListEvents(ctx, tn, atx, aid, "", 1+rng.IntN(7))
						return err
					}); err != nil {
						t.Errorf("read %s: %v", tn, err)
						return 0
					}
					for _, e := range evs {
						ntx, nid, _ := store.ParseEventCursor(e.Cursor())
						if ntx < atx || (ntx == atx && nid <= aid) {
							t.Errorf("%s: cursor went back from %d.%d to %d.%d", tn, atx, aid, ntx, nid)
						}
						atx, aid = ntx, nid
					}
					got = append(got, evs...)
					return len(evs)
				}
				for {
					select {
					case <-done:
						// Everything is committed: drain what is left.
						for _, d := range dbs {
							if err := d.WaitEventsVisible(ctx, tn, 10*time.Second); err != nil {
								t.Error(err)
							}
						}
						for page() > 0 {
						}
						reads <- read{tn, got}
						return
					default:
						if page() == 0 {
							time.Sleep(time.Millisecond)
						}
					}
				}
			}()
		}
	}
	readers.Wait()
	close(reads)

	for rd := range reads {
		pos := map[string]int{} // subject -> index in this reader's stream
		for i, e := range rd.events {
			if _, dup := pos[e.Subject]; dup {
				t.Fatalf("%s: %s read twice", rd.tenant, e.Subject)
			}
			pos[e.Subject] = i
		}
		want := 0
		lastOf := map[int]int{} // publisher -> stream index of its latest transaction's last event
		bySeq := map[[2]int][]string{}
		for _, c := range committed {
			if subs := c.subjects[rd.tenant]; len(subs) > 0 {
				bySeq[[2]int{c.publisher, c.seq}] = subs
			}
		}
		for p := range publishers {
			lastOf[p] = -1
			for s := range txsEach {
				subs, ok := bySeq[[2]int{p, s}]
				if !ok {
					continue
				}
				want += len(subs)
				first, ok := pos[subs[0]]
				if !ok {
					t.Fatalf("%s: committed %s never read", rd.tenant, subs[0])
				}
				if first <= lastOf[p] {
					t.Errorf("%s: publisher %d's transaction %d read before its earlier one", rd.tenant, p, s)
				}
				for i, sub := range subs {
					if pos[sub] != first+i {
						t.Errorf("%s: %s at %d, want %d (a transaction's events together, in order)", rd.tenant, sub, pos[sub], first+i)
					}
				}
				lastOf[p] = first + len(subs) - 1
			}
		}
		if len(rd.events) != want {
			t.Errorf("%s: read %d events, committed %d", rd.tenant, len(rd.events), want)
		}
		for _, e := range rd.events {
			var p, s, i int
			if _, err := fmt.Sscanf(e.Subject, "p%d.s%d.e%d", &p, &s, &i); err != nil || !slices.Contains(bySeq[[2]int{p, s}], e.Subject) {
				t.Errorf("%s: read %s, which no committed transaction wrote", rd.tenant, e.Subject)
			}
		}
	}
}
