package store_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// Writes that race Close (requests finishing while the process stops) are
// answered ErrClosed, never a send on a closed channel; each one that Close
// did not refuse gets its own outcome.
func TestWriteDuringCloseIsRefused(t *testing.T) {
	db, err := store.Open(context.Background(), store.Config{Path: filepath.Join(t.TempDir(), "bc.db")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const writers = 8
	var wg sync.WaitGroup
	var mu sync.Mutex
	ends := make([]error, 0, writers)
	started := make(chan struct{}, writers)
	for range writers {
		wg.Go(func() {
			first := true
			for {
				err := db.WithTx(context.Background(), func(*store.Tx) error { return nil })
				if first {
					started <- struct{}{}
					first = false
				}
				if err != nil {
					mu.Lock()
					ends = append(ends, err)
					mu.Unlock()
					return
				}
			}
		})
	}
	for range writers {
		<-started
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	// Every write after Close is refused, so every writer ends.
	wg.Wait()
	for _, err := range ends {
		if !errors.Is(err, store.ErrClosed) {
			t.Errorf("write during Close: %v, want ErrClosed", err)
		}
	}
	if err := db.WithTx(context.Background(), func(*store.Tx) error { return nil }); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("write after Close: %v, want ErrClosed", err)
	}
}
