package server

import (
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// R15.4: what an unauthenticated caller can make the server write is
// bounded. Failed TLS handshakes on the API and the agent listener write
// ErrorLinesPerMinute lines per listener per minute, each naming the
// peer; once the clock moves past the window, the next line says how many
// were suppressed. The agent listener on each of its HTTP/2 servers.
func TestHandshakeErrorLinesBounded(t *testing.T) {
	for _, h2 := range []string{AgentHTTP2Framer, AgentHTTP2NetHTTP} {
		t.Run(strings.ReplaceAll(h2, "/", ""), func(t *testing.T) { handshakeLinesBounded(t, h2) })
	}
}

func handshakeLinesBounded(t *testing.T, h2 string) {
	dir, secret, _, certFile, keyFile := tlsFixture(t)
	cfg := Config{Listen: "127.0.0.1:0", RootTenant: "root",
		TLS:   TLSConfig{CertFile: certFile, KeyFile: keyFile},
		Store: store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")},
		PKI:   PKIConfig{Dir: filepath.Join(dir, "pki")},
		Agent: AgentConfig{Listen: "127.0.0.1:0", CertFile: certFile, KeyFile: keyFile, HTTP2: h2},
	}
	c := clock.NewFake(time.Now())
	var logs wiretest.LogBuffer
	agent := make(chan string, 1)
	r := start(t, cfg, Options{Secret: secret, Clock: c, Log: slog.New(slog.NewJSONHandler(&logs, nil)), AgentReady: func(a string) { agent <- a }})
	addrs := map[string]string{"api": r.api, "agent": <-agent}
	const flood = 40
	const msg = "http: TLS handshake error"
	for _, listener := range []string{"api", "agent"} {
		t.Run(listener, func(t *testing.T) {
			var peers []string
			for range flood {
				peers = append(peers, wiretest.BadHandshake(t, addrs[listener]))
			}
			got := logs.Lines(t, msg, map[string]any{"listener": listener})
			if len(got) != ErrorLinesPerMinute {
				t.Fatalf("%d failed handshakes wrote %d lines, want %d", flood, len(got), ErrorLinesPerMinute)
			}
			for i, l := range got {
				if l["peer"] != peers[i] || l["suppressed"] != 0.0 {
					t.Errorf("line %d: %v, want peer %s, suppressed 0", i, l, peers[i])
				}
			}
		})
	}
	c.Advance(time.Minute)
	for _, listener := range []string{"api", "agent"} {
		peer := wiretest.BadHandshake(t, addrs[listener])
		got := logs.Lines(t, msg, map[string]any{"listener": listener})
		if last := got[len(got)-1]; len(got) != ErrorLinesPerMinute+1 || last["peer"] != peer || last["suppressed"] != float64(flood-ErrorLinesPerMinute) {
			t.Errorf("%s: after the window, %d lines, the last %v; want %d, peer %s, suppressed %d", listener, len(got), last, ErrorLinesPerMinute+1, peer, flood-ErrorLinesPerMinute)
		}
	}
}
