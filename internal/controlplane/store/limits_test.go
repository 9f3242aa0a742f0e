package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

func countLimited(t *testing.T, db *store.DB, key string, now time.Time, add int) store.LimitCount {
	t.Helper()
	var c store.LimitCount
	err := db.WithTx(context.Background(), func(tx *store.Tx) error {
		var err error
		c, err = tx.CountLimited(context.Background(), key, now, time.Minute, 3, add)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// R4.7: the shared counter admits per events a window, counts the dropped
// ones (and those a caller adds) into the next admitted event, keeps keys
// apart, and a clock behind the window's start never reopens it.
func TestCountLimitedR4_7(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		t0 := time.UnixMilli(1_700_000_000_000).UTC()
		type step struct {
			key      string
			at       time.Duration
			add      int
			admitted bool
			carried  int
		}
		steps := []step{
			{"t1\x1fjoin\x1fa", 0, 0, true, 0},
			{"t1\x1fjoin\x1fa", time.Second, 0, true, 0},
			{"b", time.Second, 0, true, 0}, // another key, its own budget
			{"t1\x1fjoin\x1fa", 2 * time.Second, 0, true, 0},
			{"t1\x1fjoin\x1fa", 3 * time.Second, 0, false, 0},
			{"t1\x1fjoin\x1fa", 4 * time.Second, 2, false, 0}, // dropped: 1 + 2 added + 1
			{"t1\x1fjoin\x1fa", -time.Hour, 0, false, 0},      // a clock behind: still this window
			{"t1\x1fjoin\x1fa", time.Minute, 1, true, 6},      // the window ended: 5 dropped + 1 added
			{"t1\x1fjoin\x1fa", time.Minute + time.Second, 0, true, 0},
			{"b", time.Minute, 4, true, 4}, // b's window ended too
		}
		for i, s := range steps {
			c := countLimited(t, db, s.key, t0.Add(s.at), s.add)
			if c.Admitted != s.admitted || c.Carried != s.carried {
				t.Fatalf("step %d %+v: got %+v", i, s, c)
			}
		}
		if c := countLimited(t, db, "c", t0, 0); !c.WindowStart.Equal(t0) {
			t.Errorf("window start %v, want %v", c.WindowStart, t0)
		}
	})
}

// R4.7 across replicas: 3 store handles on one PostgreSQL (3 API replicas)
// counting 100 events each at once admit 3 in all, and the next admitted
// event carries the other 297.
func TestCountLimitedAcrossReplicasR4_7(t *testing.T) {
	dbs := storetest.PostgresReplicas(t, 3)
	t0 := time.Now()
	var admitted, carried atomic.Int64
	var wg sync.WaitGroup
	for _, db := range dbs {
		for range 4 {
			wg.Go(func() {
				for range 25 {
					c := countLimited(t, db, "k", t0, 0)
					if c.Admitted {
						admitted.Add(1)
						carried.Add(int64(c.Carried))
					}
				}
			})
		}
	}
	wg.Wait()
	if admitted.Load() != 3 || carried.Load() != 0 {
		t.Fatalf("admitted %d carrying %d, want 3 carrying 0", admitted.Load(), carried.Load())
	}
	if c := countLimited(t, dbs[1], "k", t0.Add(time.Minute), 0); !c.Admitted || c.Carried != 297 {
		t.Fatalf("next window: %+v, want admitted carrying 297", c)
	}
}
