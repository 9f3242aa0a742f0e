package console

import (
	"container/list"
	"context"
	"net"
	"net/netip"
	"time"
)

// Bounds of the sessions a console keeps (R23.3). Every sign-in holds the
// key and a little state in this process's memory until it expires, so
// without bounds anyone holding one valid key could grow the process
// without limit by signing in over and over.
const (
	// DefaultMaxSessions bounds the sessions of every key together.
	DefaultMaxSessions = 10000
	// DefaultMaxSessionsPerKey bounds the sessions of one API key: the
	// browsers one operator signs in from.
	DefaultMaxSessionsPerKey = 16
	// DefaultSignInsPerMinute bounds the sign-in attempts of one source
	// address (IPv6: its /64) each minute, right or wrong.
	DefaultSignInsPerMinute = 20
	// DefaultSweepEvery is how often Run drops expired sessions.
	DefaultSweepEvery = time.Minute
)

// sessions holds the signed-in sessions in sign-in order (which is expiry
// order: every session lasts SessionTTL), indexed by id and by key. The
// oldest go first when a bound is reached. Callers hold Console.mu.
type sessions struct {
	max, maxPerKey int
	order          *list.List // of *session, oldest first
	byID           map[string]*list.Element
	byKey          map[string][]*list.Element // oldest first
}

func newSessions(max, maxPerKey int) *sessions {
	return &sessions{max: max, maxPerKey: maxPerKey, order: list.New(), byID: map[string]*list.Element{}, byKey: map[string][]*list.Element{}}
}

func (ss *sessions) get(id string) *session {
	if e := ss.byID[id]; e != nil {
		return e.Value.(*session)
	}
	return nil
}

func (ss *sessions) len() int { return ss.order.Len() }

// add stores s, first evicting the key's oldest session when the key is at
// its bound and the oldest of all when the console is at its bound.
func (ss *sessions) add(s *session) {
	for len(ss.byKey[s.key]) >= ss.maxPerKey {
		ss.remove(ss.byKey[s.key][0].Value.(*session).id)
	}
	for ss.order.Len() >= ss.max {
		ss.remove(ss.order.Front().Value.(*session).id)
	}
	e := ss.order.PushBack(s)
	ss.byID[s.id] = e
	ss.byKey[s.key] = append(ss.byKey[s.key], e)
}

func (ss *sessions) remove(id string) {
	e := ss.byID[id]
	if e == nil {
		return
	}
	s := e.Value.(*session)
	ss.order.Remove(e)
	delete(ss.byID, id)
	es := ss.byKey[s.key]
	for i, x := range es {
		if x == e {
			es = append(es[:i:i], es[i+1:]...)
			break
		}
	}
	if len(es) == 0 {
		delete(ss.byKey, s.key)
	} else {
		ss.byKey[s.key] = es
	}
}

// sweep drops the sessions expired at now and reports how many.
func (ss *sessions) sweep(now time.Time) int {
	n := 0
	for e := ss.order.Front(); e != nil && !now.Before(e.Value.(*session).expires); e = ss.order.Front() {
		ss.remove(e.Value.(*session).id)
		n++
	}
	return n
}

// Run drops expired sessions every Config.SweepEvery of the console's
// clock until ctx ends (expired sessions are refused when used anyway;
// this returns their memory). The server starts it with its other
// background loops and waits for it when it stops.
func (c *Console) Run(ctx context.Context) {
	t := c.cfg.Clock.NewTicker(c.cfg.SweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			c.mu.Lock()
			n := c.sessions.sweep(c.cfg.Clock.Now())
			c.mu.Unlock()
			if n > 0 {
				c.cfg.Log.Debug("console: expired sessions dropped", "sessions", n)
			}
		}
	}
}

// Sessions is how many sessions the console holds.
func (c *Console) Sessions() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sessions.len()
}

// source is the rate limiter's key for a request: its peer address, an
// IPv6 address's /64 (one host usually holds a whole /64).
func source(remoteAddr string) string {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return "unknown"
	}
	ip = ip.Unmap()
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return p.String()
	}
	return ip.String()
}
