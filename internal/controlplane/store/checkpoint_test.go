package store_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// R14.1, R4.4: SQLite's WAL is copied into the database file by the
// checkpointer, not inside the writer's commits, and what was committed is
// read back, also after the database is reopened. A WAL page reaches the
// database file only through a checkpoint, so the file's size tells
// whether one ran: it stays put while no checkpoint is due (SQLite's own
// automatic checkpoint, had the writer kept it, would have grown it at the
// 1,000th page), and grows once the checkpointer is woken by pages or by
// its sweep. Under a stream of writes the WAL stays near the writer's
// checkpoint interval: without the writer's own checkpoints it never
// starts again from its beginning and grows with every page written.
func TestCheckpointsOffTheWriterR14_1(t *testing.T) {
	never := time.Hour
	for _, c := range []struct {
		name   string
		pages  int64
		every  time.Duration
		rows   int
		copied bool
		// maxWAL bounds the -wal file's size at the end, when not 0.
		maxWAL int64
	}{
		{"no checkpoint before one is due", 1 << 40, never, 400, false, 0},
		{"woken by the pages written", 200, never, 400, true, 0},
		{"the sweep syncs a quiet database", 1 << 40, 20 * time.Millisecond, 3, true, 0},
		// About 3 pages a row, 6,000 in all: 24 MiB of WAL if it never
		// started again.
		{"the WAL stays near the checkpoint interval", 400, never, 2000, true, 3 * 400 * (4096 + 24)},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "bc.db")
			cfg := store.WithCheckpoints(store.Config{Path: path}, c.pages, c.every)
			db, err := store.Open(ctx, cfg, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { db.Close() }()
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				return tx.ExecRaw(ctx, "CREATE TABLE scratch (id INTEGER PRIMARY KEY, b BLOB NOT NULL)")
			}); err != nil {
				t.Fatal(err)
			}
			before := fileSize(t, path)
			for i := range c.rows {
				// 8 KiB a row: a leaf page and two overflow pages.
				if err := db.WithTx(ctx, func(tx *store.Tx) error {
					return tx.ExecRaw(ctx, "INSERT INTO scratch (id, b) VALUES (?, randomblob(8192))", i)
				}); err != nil {
					t.Fatal(err)
				}
			}
			if c.maxWAL > 0 {
				if w, got := db.WALPagesWritten(), fileSize(t, path+"-wal"); got > c.maxWAL {
					t.Fatalf("the WAL is %d bytes after %d pages written; want at most %d", got, w, c.maxWAL)
				}
			}
			if c.copied {
				poll.Until(t, 10*time.Second, "the WAL copied into the database file", func() bool { return fileSize(t, path) > before })
			} else {
				if w := db.WALPagesWritten(); w < 1000 {
					t.Fatalf("the writer appended %d WAL pages; the test needs more than SQLite's automatic checkpoint threshold (1,000)", w)
				}
				if after := fileSize(t, path); after != before {
					t.Fatalf("the database file went from %d to %d bytes with the checkpointer idle: the writer checkpointed", before, after)
				}
			}
			count := func() int64 {
				var n int64
				if err := db.ReadTx(ctx, func(tx *store.Tx) error {
					var err error
					n, err = tx.QueryInt(ctx, "SELECT COUNT(*) FROM scratch")
					return err
				}); err != nil {
					t.Fatal(err)
				}
				return n
			}
			if n := count(); n != int64(c.rows) {
				t.Fatalf("read %d rows, wrote %d", n, c.rows)
			}
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}
			if db, err = store.Open(ctx, cfg, nil); err != nil {
				t.Fatal(err)
			}
			if n := count(); n != int64(c.rows) {
				t.Fatalf("after reopening: read %d rows, wrote %d", n, c.rows)
			}
		})
	}
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}
