// Package ratelimit bounds what a flood can make a process write to its
// log: at most Per lines per key each Window, counting what it drops, so
// the next line of the key says how many were suppressed. It is the one
// in-memory limiter of the tree: the identity core's refusal lines
// (nodeident), and every server's net/http error log (TLS handshake
// failures and timeouts on the API, the agent listener and the gateway)
// and the gateway's per-call warnings go through it. (Refusal events have
// their own limiter, events.Limiter, because every API replica shares
// their count through the database; log lines are per process.)
//
// SECURITY: keys are chosen by the caller from bounded sets (a tenant,
// kind and reason; the kind of a net/http line), never from what a peer
// sends; and the number of keys is capped anyway (maxKeys): past it, new
// keys share one window, so a caller who finds a way to mint keys still
// gets a bounded number of lines. Anyone may import it.
package ratelimit

import (
	"context"
	"log"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
)

// maxKeys caps the keys with their own window; overflowKey is the one
// window every further key shares.
const (
	maxKeys     = 1024
	overflowKey = "\x00overflow"
)

// Limiter admits at most per events per key each window, on its clock. A
// key's window starts with its first event after the previous one ended.
type Limiter struct {
	clock  clock.Clock
	per    int
	window time.Duration

	mu   sync.Mutex
	keys map[string]*window
}

type window struct {
	start   time.Time
	n       int // admitted in this window
	dropped int // dropped since the last admitted event
}

// New returns a Limiter admitting per events per key each window.
func New(c clock.Clock, per int, every time.Duration) *Limiter {
	if c == nil {
		c = clock.Real{}
	}
	return &Limiter{clock: c, per: per, window: every, keys: map[string]*window{}}
}

// Allow counts an event of key and reports whether it is admitted and,
// when it is, how many of the key's events were dropped since the last one
// admitted (each dropped event is reported once).
func (l *Limiter) Allow(key string) (ok bool, suppressed int) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.keys[key]
	if w == nil {
		if len(l.keys) >= maxKeys {
			l.gc(now)
		}
		if len(l.keys) >= maxKeys {
			key = overflowKey
		}
		if w = l.keys[key]; w == nil {
			w = &window{start: now}
			l.keys[key] = w
		}
	}
	if !now.Before(w.start.Add(l.window)) {
		w.start, w.n = now, 0
	}
	if w.n >= l.per {
		w.dropped++
		return false, 0
	}
	w.n++
	suppressed, w.dropped = w.dropped, 0
	return true, suppressed
}

// gc forgets ended windows with nothing left to report.
func (l *Limiter) gc(now time.Time) {
	for k, w := range l.keys {
		if w.dropped == 0 && !now.Before(w.start.Add(l.window)) {
			delete(l.keys, k)
		}
	}
}

// Logger writes log lines through a Limiter, keyed by the caller. A line
// that is written carries "suppressed": how many of its key's lines were
// not written since the last one that was.
type Logger struct {
	log *slog.Logger
	lim *Limiter
}

// NewLogger returns a Logger writing to log through lim.
func NewLogger(log *slog.Logger, lim *Limiter) *Logger {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Logger{log: log, lim: lim}
}

// Log writes msg with args at level unless key's window is full, and
// reports whether it wrote.
func (l *Logger) Log(level slog.Level, key, msg string, args ...any) bool {
	return l.LogContext(context.Background(), level, key, msg, args...)
}

// LogContext is Log with the request's context, so the line carries what
// the handler takes from it (a traced request's trace id).
func (l *Logger) LogContext(ctx context.Context, level slog.Level, key, msg string, args ...any) bool {
	ok, n := l.lim.Allow(key)
	if ok {
		l.log.Log(ctx, level, msg, append(args, "suppressed", n)...)
	}
	return ok
}

// ErrorLog is an http.Server's ErrorLog writing through l at level. Each
// net/http line is keyed by the listener's name and its kind (the text
// before " from <peer>", e.g. "http: TLS handshake error"; a line naming no
// peer is its own kind) and written as that message with "listener", the
// peer's address as "peer" and the rest as "err".
func (l *Logger) ErrorLog(level slog.Level, listener string) *log.Logger {
	return log.New(errorWriter{l: l, level: level, listener: listener}, "", 0)
}

type errorWriter struct {
	l        *Logger
	level    slog.Level
	listener string
}

func (w errorWriter) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	kind, peer, detail := splitHTTPLine(line)
	w.l.Log(w.level, w.listener+"\x1f"+kind, kind, "listener", w.listener, "peer", peer, "err", detail)
	return len(p), nil
}

// splitHTTPLine splits a net/http log line such as "http: TLS handshake
// error from 10.0.0.7:5123: EOF" into its kind, the peer and the rest.
func splitHTTPLine(line string) (kind, peer, detail string) {
	kind, rest, ok := strings.Cut(line, " from ")
	if !ok {
		// No peer named: the kind is the text before its first ": "
		// after net/http's own "http: " prefix (bounded by maxKeys).
		pfx, body, _ := strings.Cut(line, ": ")
		k, d, _ := strings.Cut(body, ": ")
		return pfx + ": " + k, "", d
	}
	rest = strings.TrimPrefix(rest, "client ") // http2: "... from client 10.0.0.7:5123: ..."
	peer, detail, _ = strings.Cut(rest, ": ")
	return kind, peer, detail
}
