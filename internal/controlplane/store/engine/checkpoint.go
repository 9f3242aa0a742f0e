package engine

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"time"

	"modernc.org/sqlite"
)

// Checkpoints, mostly off the writer (SQLite only).
//
// In WAL mode every commit appends the pages it changed to the -wal file,
// and a checkpoint copies them back into the database file (each page once,
// its newest version) and syncs both files. SQLite's default runs that
// checkpoint inside the COMMIT that takes the WAL past 1,000 pages, on the
// committing connection: here the one writer, so every write of the
// process waited for the copy of up to 1,000 pages and two fsyncs at every
// 1,000th page (docs/contributors/performance.md, "Checkpoints off the
// writer").
//
// The writer connection has automatic checkpoints off
// (wal_autocheckpoint(0)), and the work is split in two:
//   - a checkpointer goroutine with a connection of its own runs PASSIVE
//     checkpoints, which never block the writer or a reader, while the
//     writer goes on appending: when the writer has written a quarter of
//     checkpointPages WAL pages since it was last woken (the writer
//     connection's SQLITE_DBSTATUS_CACHE_WRITE counter, read after each
//     commit), and every checkpointEvery while anything was written, so
//     that a quiet database is synced within a second of its last write
//     (synchronous=NORMAL syncs the WAL at checkpoints only: a commit is
//     safe from a process crash at once, and from a power loss once a
//     checkpoint has run; SQLite's default left that to the 1,000th page,
//     however long it took to come);
//   - every checkpointPages pages the writer itself, between two
//     transactions, runs a PASSIVE checkpoint. Most of the WAL is copied
//     by then, so it copies the pages written since the checkpointer's
//     last pass and syncs. The WAL can only start again from its beginning
//     once a checkpoint copied all of it while nobody wrote (SQLite
//     restarts it at the next write); a checkpoint running beside a busy
//     writer never gets there, and the WAL then grows without bound (2.3
//     GB in a 100,000-machine storm before this step was added).
//
// The WAL then stays near checkpointPages pages (16 MiB at SQLite's 4 KiB
// pages), unless a reader holds an old snapshot for long, which stalls
// SQLite's own checkpoints the same way. Closing the database checkpoints
// and removes the WAL as before (the last connection to close does it).

// checkpointPages is how many WAL pages the writer appends between two of
// its own checkpoints; the checkpointer is woken every quarter of it.
const checkpointPages = 4000

// checkpointEvery bounds how long a written page waits for a checkpoint.
const checkpointEvery = time.Second

type checkpointer struct {
	conn  *sql.DB // one connection, not the writer's
	db    *DB
	pages int64         // WAL pages between two of the writer's checkpoints
	every time.Duration // the sweep

	// running is held by whoever checkpoints: two checkpoints of one
	// database cannot run at once (SQLite answers the second busy).
	running sync.Mutex
	// written is every WAL page the writer appended (all its connections).
	written atomic.Int64
	// The writer's alone: written when it last woke the checkpointer, and
	// the pages appended since its own last complete checkpoint.
	woke, since int64
	// The checkpointer's alone: written when its last pass began.
	done int64

	kick          chan struct{}
	quit, stopped chan struct{}
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

// committed is called by the writer after each commit on wc, outside any
// transaction: it counts the pages wc appended, checkpoints itself every
// c.pages and wakes the checkpointer every quarter of that.
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
	c.since += n
	if c.since >= c.pages && (c.running.TryLock() || c.since >= 2*c.pages && lockNow(&c.running)) {
		// The checkpointer is not running (else this waits for the next
		// commit, and past twice the interval for its pass to end: on a
		// loaded machine its passes can follow each other so closely that
		// the writer would never find it idle, and the WAL would grow
		// without bound): copy what is left while nobody writes.
		busy, logFrames, copied, err := walCheckpoint(wc.queryRow("PRAGMA wal_checkpoint(PASSIVE)"))
		c.running.Unlock()
		switch {
		case err != nil:
			c.db.log.Warn("sqlite checkpoint", "err", err)
			c.since = c.pages * 3 / 4
		case busy != 0 || copied < logFrames:
			// A reader still needs part of the WAL: try again a little later.
			c.since = c.pages * 3 / 4
		default:
			c.since = 0
		}
		return
	}
	if w-c.woke >= c.pages/4 {
		c.woke = w
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
}

// lockNow locks mu, waiting for its holder, and reports true.
func lockNow(mu *sync.Mutex) bool {
	mu.Lock()
	return true
}

// walCheckpoint reads PRAGMA wal_checkpoint's row: busy, the frames in the
// WAL, the frames copied.
func walCheckpoint(r interface{ Scan(...any) error }) (busy, logFrames, copied int64, err error) {
	err = r.Scan(&busy, &logFrames, &copied)
	return
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
		if w == c.done {
			continue
		}
		c.done = w
		c.checkpoint()
	}
}

// checkpoint runs one PASSIVE checkpoint. A failure is logged: the next
// one copies what this one did not, and SQLite stays consistent either way.
func (c *checkpointer) checkpoint() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c.running.Lock()
	defer c.running.Unlock()
	_, logFrames, copied, err := walCheckpoint(c.conn.QueryRowContext(ctx, "PRAGMA wal_checkpoint(PASSIVE)"))
	if err != nil {
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
