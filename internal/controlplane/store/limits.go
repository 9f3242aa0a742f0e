package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// LimitCount is what CountLimited decided for one event.
type LimitCount struct {
	// Admitted reports whether the event is within the limit.
	Admitted bool
	// Carried is, for an admitted event, how many of the key's events were
	// dropped since the last admitted one (every replica's).
	Carried int
	// WindowStart is when the key's current window began; it ends
	// WindowStart plus the window.
	WindowStart time.Time
}

// CountLimited counts one event for key against a limit of per events each
// window, in one atomic upsert on the key's event_limits row, so that every
// replica on the database shares the count. A window starts with the first
// event after the previous one ended. add is a number of the key's events
// the caller dropped without asking (a replica's cache of a full window,
// events.Limiter): they join the dropped count the next admitted event
// carries.
//
// now is the caller's clock. A replica whose clock runs behind the one that
// opened the window counts into that window (it never reopens one early);
// one running ahead can open the next window early by its skew.
func (t *Tx) CountLimited(ctx context.Context, key string, now time.Time, window time.Duration, per, add int) (LimitCount, error) {
	if strings.ContainsRune(key, 0) || !utf8.ValidString(key) {
		return LimitCount{}, errors.New("count limited: the key must be UTF-8 without NUL (PostgreSQL text)")
	}
	if per < 1 || window <= 0 || add < 0 {
		return LimitCount{}, errors.New("count limited: per, window must be positive and add not negative")
	}
	// In ON CONFLICT DO UPDATE every right-hand side reads the row as it
	// was, and excluded is the row offered: its window_start_ms is now and
	// its carried is add. "fresh" is: the row's window has ended.
	const fresh = `(excluded.window_start_ms - event_limits.window_start_ms >= ?)`
	const admitted = `((CASE WHEN ` + fresh + ` THEN 1 ELSE event_limits.n + 1 END) <= ?)`
	q := `INSERT INTO event_limits (limit_key, window_start_ms, n, suppressed, carried) VALUES (?, ?, 1, 0, ?)
		ON CONFLICT (limit_key) DO UPDATE SET
			window_start_ms = CASE WHEN ` + fresh + ` THEN excluded.window_start_ms ELSE event_limits.window_start_ms END,
			n = CASE WHEN ` + fresh + ` THEN 1 ELSE event_limits.n + 1 END,
			carried = CASE WHEN ` + admitted + ` THEN event_limits.suppressed + excluded.carried ELSE event_limits.carried END,
			suppressed = CASE WHEN ` + admitted + ` THEN 0 ELSE event_limits.suppressed + excluded.carried + 1 END
		RETURNING window_start_ms, n, carried`
	w := window.Milliseconds()
	var start, n, carried int64
	err := t.queryRow(ctx, q, key, now.UnixMilli(), add, w, w, w, per, w, per).Scan(&start, &n, &carried)
	if err != nil {
		return LimitCount{}, fmt.Errorf("count limited event: %w", err)
	}
	c := LimitCount{Admitted: n <= int64(per), WindowStart: fromMS(start)}
	if c.Admitted {
		c.Carried = int(carried)
	}
	return c, nil
}
