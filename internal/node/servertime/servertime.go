// Package servertime keeps how far the control plane's clock is from this
// machine's (R19.3), so bcd dates what it stamps (a renewal's or an x509pop
// join's client_time, a seal's iat, the expiry check of a command) by the
// server's clock even when this machine's clock is off.
//
// bcd learns the server's time only from signed answers: the join and
// renewal answers, whose signed body carries the time and answers this
// very request (R21.4). The offset is what the server's clock read minus
// this machine's clock when the answer arrived; it is persisted beside the
// identity so a restart keeps it, and the next signed answer replaces it.
//
// SECURITY: whoever relays the answers (the gateway) can forge anything
// unsigned: the session's Welcome time and the Keys answer's time. Neither
// moves the offset. The Keys time is a hint (Hint) that dates one retry of
// a join or renewal refused for its time (StampNow) and nothing else: it
// is never persisted, and command expiry and the certificate's expiry
// never read it. A relay can delay a signed answer, which makes the
// offset smaller by at most the call's timeout, never larger. The
// certificate counts as expired only when both the offset and this
// machine's own clock say so (Expired), so no offset can keep bcd from
// renewing a certificate that is still valid; the server enforces its own
// windows whatever bcd claims. Offsets beyond MaxOffset are not applied.
package servertime

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
)

// File is the offset's file in the node's state directory.
const File = "server-time.json"

// MaxOffset bounds the offset applied: a clock a day off is broken
// beyond correcting, and is reported instead.
const MaxOffset = 24 * time.Hour

// Config configures an Offset.
type Config struct {
	// Dir is the node's state directory (identity.Store.Dir); "" keeps
	// the offset in memory only.
	Dir string
	// Clock is this machine's clock (nil: the real one).
	Clock clock.Clock
}

// Offset is the learned offset. The zero offset (nothing learned) dates by
// this machine's clock. Safe for concurrent use.
type Offset struct {
	cfg Config

	mu      sync.Mutex
	off     time.Duration
	learned time.Time // this machine's clock when it was learned; zero: never
	// hint is an unsigned offset (Hint) that dates what bcd stamps until
	// the next signed answer; hinted says there is one.
	hint   time.Duration
	hinted bool
}

// record is the persisted form.
type record struct {
	OffsetMs      int64 `json:"offset_ms"`
	LearnedUnixMs int64 `json:"learned_unix_ms"`
}

// New returns the offset persisted in cfg.Dir, or none. A missing or
// unreadable file is no offset: it is relearned from the next answer.
func New(cfg Config) *Offset {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	o := &Offset{cfg: cfg}
	if off, learned, err := Read(cfg.Dir); err == nil && bounded(off) {
		o.off, o.learned = off, learned
	}
	return o
}

// Read returns the offset persisted in dir and when it was learned (by
// this machine's clock), for bcd doctor. Nothing persisted is
// fs.ErrNotExist.
func Read(dir string) (offset time.Duration, learned time.Time, err error) {
	if dir == "" {
		return 0, time.Time{}, fs.ErrNotExist
	}
	data, err := os.ReadFile(filepath.Join(dir, File))
	if err != nil {
		return 0, time.Time{}, err
	}
	var r record
	if err := json.Unmarshal(data, &r); err != nil {
		return 0, time.Time{}, fmt.Errorf("read %s: %w", filepath.Join(dir, File), err)
	}
	return time.Duration(r.OffsetMs) * time.Millisecond, time.UnixMilli(r.LearnedUnixMs), nil
}

func bounded(d time.Duration) bool { return d <= MaxOffset && d >= -MaxOffset }

// Now is this machine's clock corrected by the offset: the server's clock
// as best bcd knows it. It keeps the monotonic reading of the clock, so
// durations measured between two Now calls are not disturbed by a step of
// the wall clock.
func (o *Offset) Now() time.Time {
	if o == nil {
		return clock.Real{}.Now()
	}
	o.mu.Lock()
	off := o.off
	o.mu.Unlock()
	return o.cfg.Clock.Now().Add(off)
}

// StampNow is the time bcd dates what it claims with (a renewal's or an
// x509pop join's client_time, a seal's iat): Now, or this machine's clock
// moved by the hint of an unsigned answer (Hint) when one came after the
// last signed answer. The server checks these times against its own
// clock, so a forged hint can only make the request fail.
func (o *Offset) StampNow() time.Time {
	if o == nil {
		return clock.Real{}.Now()
	}
	o.mu.Lock()
	off := o.off
	if o.hinted {
		off = o.hint
	}
	o.mu.Unlock()
	return o.cfg.Clock.Now().Add(off)
}

// Hint takes the server's time serverMs from an unsigned answer (the Keys
// answer) as a hint for StampNow, kept in memory until the next signed
// answer, and reports whether it moves what StampNow dates by more than
// moved. It never changes Now and is never persisted (R21.4). 0 and
// offsets beyond MaxOffset are ignored.
func (o *Offset) Hint(serverMs int64, moved time.Duration) bool {
	if o == nil || serverMs == 0 {
		return false
	}
	off := time.UnixMilli(serverMs).Sub(o.cfg.Clock.Now()).Round(time.Millisecond)
	if !bounded(off) {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	before := o.off
	if o.hinted {
		before = o.hint
	}
	o.hint, o.hinted = off, true
	return off-before > moved || before-off > moved
}

// Expired reports whether notAfter has passed by the control plane's clock
// as bcd knows it and by this machine's own clock too: an offset alone
// (a stale one, or one learned before a clock step) never makes a valid
// certificate look expired, so bcd still tries to renew it and the
// control plane decides (R21.4).
func (o *Offset) Expired(notAfter time.Time) bool {
	if o == nil {
		return !clock.Real{}.Now().Before(notAfter)
	}
	return !o.Now().Before(notAfter) && !o.cfg.Clock.Now().Before(notAfter)
}

// Offset returns the offset (server minus this machine) and when it was
// learned; learned is zero when nothing was.
func (o *Offset) Offset() (time.Duration, time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.off, o.learned
}

// Learn records the server's time serverMs (Unix milliseconds) read from
// a signed answer that just arrived (never from an unsigned one: Hint),
// and drops any hint. 0 (a server before the field) changes nothing; an
// offset beyond MaxOffset is not applied and is returned as an error
// naming the clock. The offset is persisted when first learned and when
// it moved by more than a second, so a renewal does not write each time.
func (o *Offset) Learn(serverMs int64) (time.Duration, error) {
	if o == nil || serverMs == 0 {
		return 0, nil
	}
	now := o.cfg.Clock.Now()
	off := time.UnixMilli(serverMs).Sub(now).Round(time.Millisecond)
	if !bounded(off) {
		return off, fmt.Errorf("%s; not correcting for it", Describe(off))
	}
	o.mu.Lock()
	moved, first := o.off-off, o.learned.IsZero()
	o.off, o.learned = off, now
	o.hint, o.hinted = 0, false
	o.mu.Unlock()
	if first || moved > time.Second || moved < -time.Second {
		return off, o.save(off, now)
	}
	return off, nil
}

func (o *Offset) save(off time.Duration, learned time.Time) error {
	if o.cfg.Dir == "" {
		return nil
	}
	data, err := json.Marshal(record{OffsetMs: off.Milliseconds(), LearnedUnixMs: learned.UnixMilli()})
	if err != nil {
		return err
	}
	if err := fsutil.WriteFileAtomic(filepath.Join(o.cfg.Dir, File), append(data, '\n'), 0o600); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// Describe names the clock for an offset (server minus this machine).
func Describe(off time.Duration) string {
	off = off.Round(time.Second)
	switch {
	case off > 0:
		return fmt.Sprintf("this machine's clock is %s behind the control plane's; fix NTP", off)
	case off < 0:
		return fmt.Sprintf("this machine's clock is %s ahead of the control plane's; fix NTP", -off)
	}
	return "this machine's clock agrees with the control plane's"
}
