package store

import (
	"context"
	"database/sql"
	"sync/atomic"
	"time"

	"modernc.org/sqlite"
)

// Checkpoints off the writer (SQLite only).
//
// In WAL mode every commit appends the pages it changed to the -wal file,
// and a checkpoint copies them back into the database file (each page once,
// its newest version) and syncs both files. SQLite's default runs that
// checkpoint inside the COMMIT that takes the WAL past 1,000 pages, on the
// committing connection: here the one writer, so every write of the
// process waited for the copy and its two fsyncs at every 1,000th page
// (docs/performance.md, "Checkpoints off the writer").
//
// The writer connection has automatic checkpoints off
// (wal_autocheckpoint(0)). A checkpointer goroutine with a connection of its
// own runs PASSIVE checkpoints, which copy what no reader still needs and
// never block the writer or a reader, while the writer goes on appending:
//   - when the writer has written checkpointPages WAL pages since the last
//     checkpoint began (read from the writer connection's
//     SQLITE_DBSTATUS_CACHE_WRITE counter after each commit), and
//   - every checkpointEvery while anything was written since the last one,
//     so that a quiet database is synced within a second of its last write
//     (synchronous=NORMAL syncs the WAL at checkpoints only: a commit is
//     safe from a process crash at once, and from a power loss once a
//     checkpoint has run; SQLite's default left that to the 1,000th page,
//     however long it took to come).
//
// The WAL then holds at most about checkpointPages pages plus what is
// written while a checkpoint runs (16 MiB at SQLite's 4 KiB pages), unless
// a reader holds an old snapshot for long, which stalls SQLite's own
// checkpoints the same way. Closing the database checkpoints and removes
// the WAL as before (the last connection to close does it).

// checkpointPages is how many WAL pages the writer appends before the
// checkpointer is woken.
const checkpointPages = 4000

// checkpointEvery bounds how long a written page waits for a checkpoint.
const checkpointEvery = time.Second

type checkpointer struct {
	conn  *sql.DB // one connection, not the writer's
	db    *DB
	pages int64         // WAL pages before a wake-up
	every time.Duration // the sweep

	// written is every WAL page the writer appended (all its connections);
	// woke is written when the checkpointer was last woken for pages, done
	// when its last checkpoint began.
	written, woke, done atomic.Int64
	kick                chan struct{}
	quit, stopped       chan struct{}
}

// newCheckpointer returns the checkpointer of db over conn; pages and
// every override checkpointPages and checkpointEvery when positive.
func newCheckpointer(db *DB, conn *sql.DB, pages int64, every time.Duration) *checkpointer {
	c := &checkpointer{conn: conn, db: db, pages: checkpointPages, every: checkpointEvery,
		kick: make(chan struct{}, 1), quit: make(chan struct{}), stopped: make(chan struct{})}
	if pages > 0 {
		c.pages = pages
	}
	if every > 0 {
		c.every = every
	}
	return c
}

// committed is called by the writer after each commit on wc: it adds the
// pages wc appended since the last call and wakes the checkpointer when
// enough have accumulated.
func (c *checkpointer) committed(wc *writerConn) {
	st, ok := wc.raw.(sqlite.DBStatus)
	if !ok {
		return
	}
	cur, _, err := st.Status(sqlite.DBStatusCacheWrite, false)
	if err != nil {
		return
	}
	n := int64(cur) - wc.walPages
	wc.walPages = int64(cur)
	if n <= 0 {
		return
	}
	w := c.written.Add(n)
	if w-c.woke.Load() >= c.pages {
		c.woke.Store(w)
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
}

func (c *checkpointer) run() {
	defer close(c.stopped)
	tick := time.NewTicker(c.every)
	defer tick.Stop()
	for {
		select {
		case <-c.quit:
			return
		case <-c.kick:
		case <-tick.C:
		}
		w := c.written.Load()
		if w == c.done.Load() {
			continue
		}
		c.done.Store(w)
		c.checkpoint()
	}
}

// checkpoint runs one PASSIVE checkpoint. A failure is logged: the next
// one copies what this one did not, and SQLite stays consistent either way.
func (c *checkpointer) checkpoint() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var busy, logFrames, copied int64
	if err := c.conn.QueryRowContext(ctx, "PRAGMA wal_checkpoint(PASSIVE)").Scan(&busy, &logFrames, &copied); err != nil {
		c.db.log.Warn("sqlite checkpoint", "err", err)
		return
	}
	c.db.log.Debug("sqlite checkpoint", "wal_pages", logFrames, "copied", copied)
}

func (c *checkpointer) stop() {
	close(c.quit)
	<-c.stopped
	_ = c.conn.Close()
}
