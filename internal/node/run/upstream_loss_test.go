package run_test

import (
	"io"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/node/run"
)

// cutProxy forwards TCP connections to an address (the API's agent
// listener) and cuts every one it carries on demand, as a network cut or
// a replica's host going away does; it keeps accepting new ones.
type cutProxy struct {
	url string

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

// newCutProxy forwards to target (https://host:port) until the test ends.
func newCutProxy(t *testing.T, target string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{url: "https://" + ln.Addr().String()}
	addr := strings.TrimPrefix(target, "https://")
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", addr)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, up)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); up.Close() }()
			go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

// cut closes every connection carried so far, both ends.
func (p *cutProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// R19.3: the gateway's connection to the API lost (a network cut, the
// replica's host gone) ends the sessions it carried at once, on either
// relay: the API ends its side, bcd is told and waits its first reconnect
// (5 s with the middle jitter) on its clock, and then opens its session
// again through the same gateway, over a new connection to the API.
func TestUpstreamLossEndsSessionsR19_3(t *testing.T) {
	each(t, func(t *testing.T, h *harness) {
		proxy := newCutProxy(t, h.agentURL)
		gwAddr, _ := h.startGateway(t, proxy.url)
		m := h.join(t, h.token(t, h.pool(t, "p", nil), false), 196, 2)
		p := h.startVia(t, m, "https://"+gwAddr)
		p.welcome(t)
		sessions := h.e.Server.Sessions()
		eventually(t, "the API to hold the session", func() bool { return sessions.Connected(m.nodeID) })

		proxy.cut()
		eventually(t, "the API to end the session", func() bool { return !sessions.Connected(m.nodeID) })
		if !h.disconnectedBecause(t, m.nodeID, "closed") {
			t.Error("no node.disconnected event with reason closed")
		}
		first := run.FirstReconnectSpread / 2
		p.waitDeadline(t, "bcd's first reconnect", p.clock.Now().Add(first))

		p.clock.Advance(first)
		if id := p.welcome(t); id != m.nodeID {
			t.Fatalf("Welcome names %s", id)
		}
		if c := h.waitCommand(t, h.enqueue(t, m.nodeID)); c.State != store.CommandDone || !strings.Contains(string(c.Result), `"cpus":2`) {
			t.Errorf("command after the cut: %s %q %s", c.State, c.Error, c.Result)
		}
	})
}
