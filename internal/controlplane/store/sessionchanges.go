package store

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"
)

// The session change feed (session_changes, migration 00025).
//
// Triggers on nodes and node_certs write a row (seq, node_id, changed_ms)
// in the transaction of every change that can end a node's session: the
// node retired, its identity generation moved (a reclaim), a newer session
// took it over, one of its certificates revoked, superseded by a renewal
// or changed otherwise, the node or a certificate gone. A replica holding
// sessions reads the rows after its position every check (SessionFeed.Read)
// and checks only the sessions it holds of those nodes (ChangedSessions):
// a check costs what changed, not what is held.
//
// seq comes from a sequence (PostgreSQL) or AUTOINCREMENT (SQLite). On
// PostgreSQL a transaction can take a seq and commit after one that took a
// higher seq was read; the reader then passed a hole. A SessionFeed
// remembers the holes it passed and reads them again, by seq, until they
// fill or FeedGapWait went by: a hole is a transaction still committing,
// or one that rolled back (or a sequence's skip after a crash), which never
// fills. A commit slower than FeedGapWait is left to the caller's periodic
// full check. SQLite's one writer commits in seq order, so its holes are
// only rolled-back ones.

// Feed tuning.
const (
	// FeedGapWait is how long a reader looks again for a hole it passed:
	// far longer than any write transaction takes from its change to its
	// commit.
	FeedGapWait = 10 * time.Second
	// FeedRetention is how long a row is kept after the pruning reader
	// read past it (PruneSessionChanges).
	FeedRetention = 10 * time.Minute
	// feedMaxGaps bounds the holes a reader remembers; past it Read reports
	// that changes may have been missed.
	feedMaxGaps = 1024
	// feedLookback is how many seqs before the newest a reader starts at:
	// a transaction still committing when the reader started took its seq
	// shortly before the newest (there are at most a few dozen writers at
	// a time), and the reader sees it, a hole, once it commits.
	feedLookback = 256
	// feedPage is the most rows one statement reads.
	feedPage = 4096
	// feedMarkEvery is how often a reader notes its position for pruning.
	feedMarkEvery = time.Minute
)

// SessionFeed is one reader's position in the session change feed: the
// highest seq it read, the holes below it it still looks for, and what it
// needs to tell which rows every reader is done with. It is not safe for
// concurrent use (the session service's poll goroutine owns its one).
type SessionFeed struct {
	started bool
	last    int64
	gaps    map[int64]time.Time // seq -> when it was passed
	readAt  time.Time           // the last successful Read
	marks   []feedMark          // positions, oldest first, at most one per feedMarkEvery
}

type feedMark struct {
	at   time.Time
	last int64
}

// Started reports whether the feed has a position (Start).
func (f *SessionFeed) Started() bool { return f.started }

// Reset forgets the position: the next reader must Start again (the
// caller then checks every session it holds, as changes before the new
// position are not read).
func (f *SessionFeed) Reset() { *f = SessionFeed{} }

// Start places the feed feedLookback seqs before the newest row (or at 0),
// and reports the newest seq. The caller checks every session it holds
// after Start: the feed then tells it every change from there on.
func (f *SessionFeed) Start(ctx context.Context, t *Tx, now time.Time) error {
	newest, err := t.newestSessionChange(ctx)
	if err != nil {
		return err
	}
	*f = SessionFeed{started: true, last: max(0, newest-feedLookback), gaps: map[int64]time.Time{}, readAt: now}
	return nil
}

// Behind reports whether the table's newest row is below the feed's
// position: the table was emptied or restored from an older copy, and the
// feed must Start again or it would skip every row up to its old
// position.
func (f *SessionFeed) Behind(ctx context.Context, t *Tx) (bool, error) {
	if !f.started {
		return true, nil
	}
	newest, err := t.newestSessionChange(ctx)
	if err != nil {
		return false, err
	}
	return newest < f.last, nil
}

func (t *Tx) newestSessionChange(ctx context.Context) (int64, error) {
	var newest int64
	if err := t.queryRow(ctx, "SELECT COALESCE(MAX(seq), 0) FROM session_changes").Scan(&newest); err != nil {
		return 0, fmt.Errorf("read the session change feed: %w", err)
	}
	return newest, nil
}

// feedGapSizes are the hole-list sizes Read pads to (padding is seq -1,
// which no row has), so the statement caches hold three texts.
var feedGapSizes = []int{16, 128, feedMaxGaps}

var feedGapTexts = func() map[int]string {
	m := map[int]string{}
	for _, n := range feedGapSizes {
		m[n] = "SELECT seq, node_id FROM session_changes WHERE seq IN (" + strings.TrimSuffix(strings.Repeat("?, ", n), ", ") + ")"
	}
	return m
}()

// Read returns the nodes of the rows committed since the last Read (the
// rows after the position, and the holes it passed that filled since), in
// seq order, a node once per row. complete is false when changes may have
// been missed: the feed was not read for longer than a reader may lag
// behind pruning, or it passed more holes than it can remember; the caller
// then checks every session it holds (the feed goes on from its new
// position).
func (f *SessionFeed) Read(ctx context.Context, t *Tx, now time.Time) (nodes []string, complete bool, err error) {
	if !f.started {
		return nil, false, fmt.Errorf("read the session change feed: not started")
	}
	complete = now.Sub(f.readAt) < FeedRetention/2
	if len(f.gaps) > 0 {
		filled, err := f.readGaps(ctx, t)
		if err != nil {
			return nil, false, err
		}
		nodes = append(nodes, filled...)
	}
	for {
		rows, err := t.query(ctx, "SELECT seq, node_id FROM session_changes WHERE seq > ? ORDER BY seq LIMIT ?", f.last, feedPage)
		if err != nil {
			return nil, false, fmt.Errorf("read the session change feed: %w", err)
		}
		n := 0
		for rows.Next() {
			var seq int64
			var node string
			if err := rows.Scan(&seq, &node); err != nil {
				rows.Close()
				return nil, false, fmt.Errorf("read the session change feed: %w", err)
			}
			n++
			if seq <= f.last {
				continue
			}
			if !f.passed(f.last+1, seq, now) {
				complete = false
			}
			f.last = seq
			nodes = append(nodes, node)
		}
		err = rows.Err()
		rows.Close()
		if err != nil {
			return nil, false, fmt.Errorf("read the session change feed: %w", err)
		}
		if n < feedPage {
			break
		}
	}
	for seq, at := range f.gaps {
		if now.Sub(at) >= FeedGapWait {
			delete(f.gaps, seq)
		}
	}
	f.readAt = now
	if len(f.marks) == 0 || now.Sub(f.marks[len(f.marks)-1].at) >= feedMarkEvery {
		f.marks = append(f.marks, feedMark{at: now, last: f.last})
	}
	return nodes, complete, nil
}

// passed records the holes from..to-1 the feed passed at now; false when
// they do not all fit (they are then not looked for again).
func (f *SessionFeed) passed(from, to int64, now time.Time) bool {
	if to-from > int64(feedMaxGaps-len(f.gaps)) {
		return false
	}
	for seq := from; seq < to; seq++ {
		f.gaps[seq] = now
	}
	return true
}

// readGaps reads the rows that filled holes the feed passed.
func (f *SessionFeed) readGaps(ctx context.Context, t *Tx) ([]string, error) {
	gaps := make([]int64, 0, len(f.gaps))
	for seq := range f.gaps {
		gaps = append(gaps, seq)
	}
	slices.Sort(gaps)
	size := feedGapSizes[len(feedGapSizes)-1]
	for _, n := range feedGapSizes {
		if len(gaps) <= n {
			size = n
			break
		}
	}
	args := make([]any, size)
	for i := range args {
		args[i] = int64(-1)
		if i < len(gaps) {
			args[i] = gaps[i]
		}
	}
	rows, err := t.query(ctx, feedGapTexts[size], args...)
	if err != nil {
		return nil, fmt.Errorf("read the session change feed: %w", err)
	}
	defer rows.Close()
	var nodes []string
	for rows.Next() {
		var seq int64
		var node string
		if err := rows.Scan(&seq, &node); err != nil {
			return nil, fmt.Errorf("read the session change feed: %w", err)
		}
		if _, ok := f.gaps[seq]; ok {
			delete(f.gaps, seq)
			nodes = append(nodes, node)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the session change feed: %w", err)
	}
	return nodes, nil
}

// Prunable returns the highest seq this reader read past at least
// FeedRetention before now (0: none), and forgets older marks. Rows up to
// it are done with: every reader that has not read them for that long
// checks every session it holds instead (Read's complete).
func (f *SessionFeed) Prunable(now time.Time) int64 {
	upTo := int64(0)
	i := 0
	for ; i < len(f.marks) && now.Sub(f.marks[i].at) >= FeedRetention; i++ {
		upTo = f.marks[i].last
	}
	if i > 1 {
		f.marks = f.marks[i-1:]
	}
	return upTo
}

// PruneSessionChanges deletes the feed's rows up to seq upTo, except the
// newest row (a reader starting places itself by it), and returns how many
// it deleted.
func (t *Tx) PruneSessionChanges(ctx context.Context, upTo int64) (int64, error) {
	res, err := t.exec(ctx, "DELETE FROM session_changes WHERE seq <= ? AND seq < (SELECT MAX(seq) FROM session_changes)", upTo)
	if err != nil {
		return 0, fmt.Errorf("prune the session change feed: %w", err)
	}
	return res.RowsAffected()
}

// OldestSessionChange returns the lowest seq in the feed (0: it is empty).
func (t *Tx) OldestSessionChange(ctx context.Context) (int64, error) {
	var oldest int64
	if err := t.queryRow(ctx, "SELECT COALESCE(MIN(seq), 0) FROM session_changes").Scan(&oldest); err != nil {
		return 0, fmt.Errorf("read the session change feed: %w", err)
	}
	return oldest, nil
}
