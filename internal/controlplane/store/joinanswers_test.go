package store_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

func digestOf(s string) []byte {
	sum := sha256.Sum256([]byte(s))
	return sum[:]
}

func getAnswer(t *testing.T, db *store.DB, digest []byte) (store.JoinAnswer, error) {
	t.Helper()
	var a store.JoinAnswer
	err := db.ReadTx(context.Background(), func(tx *store.Tx) error {
		var err error
		a, err = tx.GetJoinAnswer(context.Background(), digest)
		return err
	})
	return a, err
}

func insertAnswer(db *store.DB, a store.JoinAnswer) error {
	return db.WithTx(context.Background(), func(tx *store.Tx) error { return tx.InsertJoinAnswer(context.Background(), a) })
}

// R4.9: the answer to a join request is kept by the request's digest until
// it expires at the database's clock; a second answer for one request is a
// unique violation; expired answers are replaced and deleted in batches.
func TestJoinAnswers(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		d1, d2, d3 := digestOf("one"), digestOf("two"), digestOf("three")
		if _, err := getAnswer(t, db, d1); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("absent answer: %v, want ErrNotFound", err)
		}
		first := store.JoinAnswer{RequestDigest: d1, NodeID: "node_01k5x", Response: []byte("signed answer 1"), TTL: 10 * time.Minute}
		if err := insertAnswer(db, first); err != nil {
			t.Fatal(err)
		}
		got, err := getAnswer(t, db, d1)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got.RequestDigest, d1) || got.NodeID != first.NodeID || string(got.Response) != "signed answer 1" ||
			got.ExpiresAt.Sub(got.CreatedAt) != 10*time.Minute {
			t.Fatalf("answer %+v", got)
		}
		if d := time.Since(got.CreatedAt); d > time.Minute || d < -time.Minute {
			t.Fatalf("created at %s: not compute_now()", got.CreatedAt)
		}

		// The same request answered again: a unique violation, and the
		// first answer stands.
		err = insertAnswer(db, store.JoinAnswer{RequestDigest: d1, NodeID: "node_01k5y", Response: []byte("signed answer 2"), TTL: time.Hour})
		if !store.IsUniqueViolation(err) {
			t.Fatalf("second answer: %v, want a unique violation", err)
		}
		if got, err := getAnswer(t, db, d1); err != nil || string(got.Response) != "signed answer 1" {
			t.Fatalf("after a duplicate: %+v %v", got, err)
		}

		// An answer in a transaction that rolls back is not kept.
		boom := errors.New("boom")
		err = db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: d3, Response: []byte("x"), TTL: time.Hour}); err != nil {
				return err
			}
			return boom
		})
		if !errors.Is(err, boom) {
			t.Fatal(err)
		}
		if _, err := getAnswer(t, db, d3); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("rolled-back answer: %v", err)
		}

		// Expiry is on compute_now(): moving the database's clock past
		// a short answer hides it, and the same digest may be answered anew.
		if err := insertAnswer(db, store.JoinAnswer{RequestDigest: d2, Response: []byte("short"), TTL: time.Minute}); err != nil {
			t.Fatal(err)
		}
		if err := db.SetClockOffset(ctx, 2*time.Minute); err != nil {
			t.Fatal(err)
		}
		if _, err := getAnswer(t, db, d2); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("expired answer: %v, want ErrNotFound", err)
		}
		if _, err := getAnswer(t, db, d1); err != nil {
			t.Fatalf("live answer: %v", err)
		}
		if err := insertAnswer(db, store.JoinAnswer{RequestDigest: d2, Response: []byte("anew"), TTL: time.Minute}); err != nil {
			t.Fatalf("answering an expired digest anew: %v", err)
		}
		if got, err := getAnswer(t, db, d2); err != nil || string(got.Response) != "anew" {
			t.Fatalf("answer anew: %+v %v", got, err)
		}

		// Batched deletion of expired answers only.
		for i, ttl := range []time.Duration{time.Minute, time.Minute, time.Minute, 24 * time.Hour} {
			if err := insertAnswer(db, store.JoinAnswer{RequestDigest: digestOf(string(rune('a' + i))), Response: []byte("b"), TTL: ttl}); err != nil {
				t.Fatal(err)
			}
		}
		if err := db.SetClockOffset(ctx, time.Hour); err != nil {
			t.Fatal(err)
		}
		// Expired now: d1 (10 min), d2 (1 min), a, b, c; live: d ("24 h").
		deleted := 0
		for _, want := range []int{2, 2, 1, 0} {
			var n int
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				var err error
				n, err = tx.DeleteExpiredJoinAnswers(ctx, 2)
				return err
			})
			if err != nil || n != want {
				t.Fatalf("DeleteExpiredJoinAnswers = %d, %v; want %d", n, err, want)
			}
			deleted += n
		}
		if deleted != 5 {
			t.Fatalf("deleted %d", deleted)
		}
		if _, err := getAnswer(t, db, digestOf("d")); err != nil {
			t.Fatalf("the live answer was deleted: %v", err)
		}
		if err := db.SetClockOffset(ctx, 0); err != nil {
			t.Fatal(err)
		}
		// Deleted, not only hidden: with the clock back, d1 is gone.
		if _, err := getAnswer(t, db, d1); !errors.Is(err, store.ErrNotFound) {
			t.Fatalf("deleted answer: %v", err)
		}
	})
}

// R4.9: InsertJoinAnswer refuses what cannot be an answer.
func TestJoinAnswerRefusals(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		for name, a := range map[string]store.JoinAnswer{
			"no digest":   {Response: []byte("x"), TTL: time.Minute},
			"no TTL":      {RequestDigest: digestOf("x"), Response: []byte("x")},
			"no response": {RequestDigest: digestOf("x"), TTL: time.Minute},
		} {
			if err := insertAnswer(db, a); err == nil || store.IsUniqueViolation(err) {
				t.Errorf("%s: %v", name, err)
			}
		}
		err := db.WithTx(context.Background(), func(tx *store.Tx) error {
			n, err := tx.DeleteExpiredJoinAnswers(context.Background(), 0)
			if n != 0 {
				t.Errorf("limit 0 deleted %d", n)
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	})
}

// R4.9: two transactions answering one request at once: exactly one answer
// is stored, and the other transaction fails with a unique violation.
func TestJoinAnswerRace(t *testing.T) {
	storetest.Each(t, func(t *testing.T, db *store.DB) {
		ctx := context.Background()
		digest := digestOf("raced")
		const n = 8
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = db.WithTx(ctx, func(tx *store.Tx) error {
					if _, err := tx.GetJoinAnswer(ctx, digest); err == nil {
						return errors.New("already answered")
					} else if !errors.Is(err, store.ErrNotFound) {
						return err
					}
					return tx.InsertJoinAnswer(ctx, store.JoinAnswer{RequestDigest: digest, Response: []byte{byte(i)}, TTL: time.Hour})
				})
			}()
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			switch {
			case err == nil:
				won++
			case store.IsUniqueViolation(err), err.Error() == "already answered":
			default:
				t.Errorf("racing answer: %v", err)
			}
		}
		if won != 1 {
			t.Fatalf("%d transactions stored an answer, want 1", won)
		}
		if _, err := getAnswer(t, db, digest); err != nil {
			t.Fatal(err)
		}
	})
}
