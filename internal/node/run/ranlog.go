package run

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
)

// RanFile is the file in the data directory that remembers the commands
// bcd ran (R12.3), so that a command delivered again, by a relay replaying
// it or after a lost answer, is answered and never run twice, across
// restarts too.
const RanFile = "commands-run.json"

const (
	// ranGrace keeps an id this long after its command expired by this
	// machine's own clock. bcd checks expiry by the control plane's clock
	// as it knows it, up to servertime.MaxOffset off its own, so an id is
	// kept that much longer (R21.4): whatever offset bcd learned, a command
	// it still takes for unexpired is still remembered if it ran. Ten
	// minutes more cover a clock stepping back a little.
	ranGrace = servertime.MaxOffset + 10*time.Minute
	// maxRan bounds the ids remembered: commands expire within a day, and
	// only the control plane can sign one.
	maxRan     = 32768
	ranVersion = 1
)

// ranState is what begin found.
type ranState int

const (
	ranFresh   ranState = iota // recorded now: run it
	ranRunning                 // running in this process: its answer will come
	ranBefore                  // ran before (maybe before a restart): answer, do not run
)

// ranLog is the on-disk set of command ids bcd ran, each kept until its
// command's expiry (plus ranGrace). An id is written, atomically and
// synced (fsutil.WriteFileAtomic), BEFORE its command runs: a process that
// dies mid-command never runs it again (at most once).
type ranLog struct {
	path  string
	clock clock.Clock

	mu      sync.Mutex
	loaded  bool
	ids     map[string]int64 // id -> keep until, Unix ms
	running map[string]struct{}
}

// ranFileBody is RanFile's content.
type ranFileBody struct {
	Version  int              `json:"version"`
	Commands map[string]int64 `json:"commands"` // id -> keep until, Unix ms
}

func newRanLog(dir string, c clock.Clock) *ranLog {
	return &ranLog{path: filepath.Join(dir, RanFile), clock: c, running: map[string]struct{}{}}
}

// loadLocked reads the file once. A missing file is an empty log; a file
// that does not parse fails closed (no command runs): forgetting it would
// let a captured command run again.
func (l *ranLog) loadLocked() error {
	if l.loaded {
		return nil
	}
	b, err := os.ReadFile(l.path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		l.ids = map[string]int64{}
	case err != nil:
		return fmt.Errorf("read %s: %w", l.path, err)
	default:
		var body ranFileBody
		if err := json.Unmarshal(b, &body); err != nil || body.Version != ranVersion || body.Commands == nil {
			return fmt.Errorf("%s is damaged; no command runs until it is repaired (it lists the commands this node ran, so that none runs twice)", l.path)
		}
		l.ids = body.Commands
	}
	l.loaded = true
	return nil
}

// begin records id (kept until expires plus ranGrace) before its command
// runs, and says whether to run it. An error means it was not recorded and
// must not run.
func (l *ranLog) begin(id string, expires time.Time) (ranState, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.running[id]; ok {
		return ranRunning, nil
	}
	if err := l.loadLocked(); err != nil {
		return 0, err
	}
	if _, ok := l.ids[id]; ok {
		return ranBefore, nil
	}
	now := l.clock.Now().UnixMilli()
	next := make(map[string]int64, len(l.ids)+1)
	for k, until := range l.ids {
		if until > now {
			next[k] = until
		}
	}
	if len(next) >= maxRan {
		return 0, fmt.Errorf("%d unexpired commands are remembered already", len(next))
	}
	next[id] = expires.Add(ranGrace).UnixMilli()
	b, err := json.Marshal(ranFileBody{Version: ranVersion, Commands: next})
	if err != nil {
		return 0, err
	}
	if err := fsutil.WriteFileAtomic(l.path, b, 0o600); err != nil {
		return 0, err
	}
	l.ids = next
	l.running[id] = struct{}{}
	return ranFresh, nil
}

// end marks id's run over (its answer is on its way).
func (l *ranLog) end(id string) {
	l.mu.Lock()
	delete(l.running, id)
	l.mu.Unlock()
}
