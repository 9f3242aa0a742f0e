package run_test

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/session"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// startClocked is startWith with bcd's clock starting at at.
func (h *harness) startClocked(t *testing.T, m *machine, gatewayURL string, renewed <-chan struct{}, at time.Time) *bcdProc {
	t.Helper()
	cfg := *m.cfg
	cfg.GatewayURL = gatewayURL
	p := &bcdProc{clock: clock.NewFake(at), welcomes: make(chan string, 16), done: make(chan error, 1)}
	d, err := run.New(run.Config{BCD: &cfg, Store: m.store, Log: quiet(), Clock: p.clock, Rand: func() float64 { return 0.5 },
		OnWelcome: func(id string) { p.welcomes <- id }, Renewed: renewed})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.cancel = cancel
	go func() { p.done <- d.Run(ctx) }()
	t.Cleanup(func() { p.stop(t) })
	return p
}

// renewNow renews m's certificate through the real gateway as the
// renewer does, with clk as the renewer's clock, and returns the renewed
// identity (saved in m's data directory).
func (h *harness) renewNow(t *testing.T, m *machine, clk clock.Clock) *identity.Identity {
	t.Helper()
	cfg := *m.cfg
	cfg.GatewayURL = "https://" + h.gwAddr
	r, err := renew.New(renew.Config{BCD: &cfg, Store: m.store, Clock: clk, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	next, err := r.RenewOnce(ctxT(t))
	if err != nil {
		t.Fatalf("renew: %v", err)
	}
	return next
}

// R13.2: a renewal while the session is up on the certificate renewed is a
// call on the session's own connection (renew.SessionConn): the renewer
// opens no connection, the control plane admits it on the certificate the
// session's connection presents, and the session then moves to the
// renewed certificate.
func TestRenewalOverTheSessionsConnectionR13_2(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 180, 2)
		m.conn = &renew.SessionConn{}
		renewed := make(chan struct{}, 1)
		p := h.startWith(t, m, "https://"+h.gwAddr, renewed)
		p.welcome(t)
		cfg := *m.cfg
		cfg.GatewayURL = "https://" + h.gwAddr
		var own atomic.Int64
		r, err := renew.New(renew.Config{BCD: &cfg, Store: m.store, Clock: p.clock, Log: quiet(), Session: m.conn,
			HTTPClient: func(c *tls.Config) *http.Client { own.Add(1); return enroll.DefaultHTTPClient(c) }})
		if err != nil {
			t.Fatal(err)
		}
		eventually(t, "the session offered to the renewer", func() bool { return m.conn.For(m.id.Serial) != nil })
		next, err := r.RenewOnce(ctxT(t))
		if err != nil {
			t.Fatalf("renewal over the session's connection: %v", err)
		}
		if n := own.Load(); n != 0 {
			t.Fatalf("the renewer made %d clients of its own, want none", n)
		}
		renewed <- struct{}{}
		if id := p.welcome(t); id != m.nodeID {
			t.Fatalf("Welcome names %s", id)
		}
		eventually(t, "a node.connected event on the renewed certificate", func() bool { return h.connectedOn(t, m.nodeID, next.Serial) })
		eventually(t, "the renewed session offered", func() bool { return m.conn.For(next.Serial) != nil && m.conn.For(m.id.Serial) == nil })
	})
}

// waitDeadline waits until one of p's timers fires at want.
func (p *bcdProc) waitDeadline(t testing.TB, what string, want time.Time) {
	t.Helper()
	eventually(t, what, func() bool {
		for _, d := range p.clock.Deadlines() {
			if d.Equal(want) {
				return true
			}
		}
		return false
	})
}

// connectedOn reports whether a node.connected event names serial.
func (h *harness) connectedOn(t testing.TB, nodeID, serial string) bool {
	for _, ev := range h.events(t, "node.connected") {
		var d map[string]any
		_ = json.Unmarshal(ev.Data, &d)
		if ev.Subject == nodeID && d["certSerial"] == serial {
			return true
		}
	}
	return false
}

// refusingGateway is a gateway address that closes every connection it
// accepts (a gateway restarting), open until the test ends.
func refusingGateway(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return "https://" + ln.Addr().String()
}

// R19.3: a session that ends while a renewed certificate waits on disk
// (the renewer saved it, and no signal or identity check told the
// session) is not a failure: bcd reconnects at once on the new
// certificate, without a backoff (bcd's clock never moves here, so a
// backoff would never end).
func TestSessionEndAfterRenewalReconnectsAtOnceR19_3(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 150, 2)
		p := h.start(t, m)
		p.welcome(t)
		next := h.renewNow(t, m, p.clock)
		// The API ends the old session (idle: bcd's heartbeats are on its
		// unmoved clock).
		h.clock.Advance(3*session.DefaultHeartbeat + session.DefaultCheck)
		if id := p.welcome(t); id != m.nodeID {
			t.Fatalf("the session after the renewal welcomed %s", id)
		}
		eventually(t, "a node.connected event on the renewed certificate", func() bool { return h.connectedOn(t, m.nodeID, next.Serial) })
	})
}

// R19.3: bcd does not open a session on a certificate that expires before
// the next heartbeat: it waits for the renewal (until the expiry at the
// latest) and opens the session on the renewed certificate once the
// renewer says so; a certificate that expires meanwhile ends bcd with the
// expiry message.
func TestNoSessionOnExpiringCertificateR19_3(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		t.Run("renewed while waiting", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "renewed", nil), false), 160, 2)
			renewed := make(chan struct{}, 1)
			p := h.startClocked(t, m, "https://"+h.gwAddr, renewed, m.id.NotAfter.Add(-5*time.Second))
			// bcd waits until the expiry at the latest, without a session.
			p.waitDeadline(t, "bcd to wait for the renewal until the expiry", m.id.NotAfter)
			if n := h.node(t, m.nodeID); n.Connection == store.Connected {
				t.Fatal("bcd opened a session on a certificate that expires in 5 s")
			}
			// The renewal lands a minute later on the API's clock (and the
			// renewer's), so the new certificate outlives bcd's clock by
			// more than a heartbeat.
			h.clock.Advance(time.Minute)
			next := h.renewNow(t, m, h.clock)
			renewed <- struct{}{}
			if id := p.welcome(t); id != m.nodeID {
				t.Fatalf("Welcome names %s", id)
			}
			eventually(t, "a node.connected event on the renewed certificate", func() bool { return h.connectedOn(t, m.nodeID, next.Serial) })
		})
		t.Run("expired while waiting", func(t *testing.T) {
			m := h.join(t, h.token(t, h.pool(t, "expired", nil), false), 161, 2)
			p := h.startClocked(t, m, "https://"+h.gwAddr, nil, m.id.NotAfter.Add(-5*time.Second))
			p.waitDeadline(t, "bcd to wait for the renewal until the expiry", m.id.NotAfter)
			p.clock.Advance(5 * time.Second)
			if err := p.exited(t); err == nil || !strings.Contains(err.Error(), "the certificate expired at") {
				t.Fatalf("bcd run: %v, want the expiry message", err)
			}
		})
	})
}

// R19.3: while the gateway is down bcd reconnects with a capped,
// exponential backoff (the first drawn from [0, 10 s), then 2 s, 4 s, …
// with the middle jitter), never in a hot loop; a renewal meanwhile ends
// the wait and starts the backoff over.
func TestBackoffStartsOverAfterRenewalR19_3(t *testing.T) {
	eachOn(t, defaultOnly, func(t *testing.T, h *harness) {
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 170, 2)
		renewed := make(chan struct{}, 1)
		p := h.startWith(t, m, refusingGateway(t), renewed)
		waits := []time.Duration{run.FirstReconnectSpread / 2, 2 * time.Second, 4 * time.Second}
		for i, wait := range waits {
			p.waitDeadline(t, "bcd's backoff of "+wait.String(), p.clock.Now().Add(wait))
			if i < len(waits)-1 {
				p.clock.Advance(wait)
			}
		}
		h.renewNow(t, m, p.clock)
		renewed <- struct{}{}
		// The next attempt (still refused) is the first of a new identity.
		p.waitDeadline(t, "bcd's backoff to start over", p.clock.Now().Add(run.FirstReconnectSpread/2))
	})
}
