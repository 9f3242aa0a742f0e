package gateway

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// R15.4: what anyone who reaches the gateway can make it write is bounded.
// Failed TLS handshakes, and relays that fail because the API is down, write
// LinesPerMinute lines per kind per minute, each naming the peer; once the
// clock moves past the window the next line says how many were suppressed.
// On each daemon-side HTTP/2 server.
func TestGatewayLinesBounded(t *testing.T) {
	onBothServers(t, linesBounded)
}

func linesBounded(t *testing.T, e *env) {
	c := clock.NewFake(testNow)
	var logs wiretest.LogBuffer
	_, gw := startGatewayWith(t, e.config("https://"+droppingListener(t)), Options{Log: slog.New(slog.NewJSONHandler(&logs, nil)), Clock: c})
	const flood = 30
	tests := []struct {
		name string
		msg  string
		with map[string]any
		do   func(t *testing.T) string // one caller's attempt; returns its address
	}{
		{"failed handshakes", "http: TLS handshake error", map[string]any{"listener": "gateway"},
			func(t *testing.T) string { return wiretest.BadHandshake(t, gw) }},
		{"joins while the API is down", "relay to the API failed", nil, func(t *testing.T) string {
			d := newDaemon(t, e, gw)
			defer d.tr.CloseIdleConnections()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := d.client.Join(ctx, connect.NewRequest(&agentv1.JoinRequest{})); connect.CodeOf(err) != connect.CodeUnavailable {
				t.Fatalf("join through a gateway whose API is down: %v, want UNAVAILABLE", err)
			}
			return d.addr()
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var peers []string
			for range flood {
				peers = append(peers, tc.do(t))
			}
			got := logs.Lines(t, tc.msg, tc.with)
			if len(got) != LinesPerMinute {
				t.Fatalf("%d attempts wrote %d lines, want %d", flood, len(got), LinesPerMinute)
			}
			for i, l := range got {
				if l["peer"] != peers[i] || l["suppressed"] != 0.0 {
					t.Errorf("line %d: %v, want peer %s, suppressed 0", i, l, peers[i])
				}
			}
			c.Advance(time.Minute)
			peer := tc.do(t)
			got = logs.Lines(t, tc.msg, tc.with)
			if last := got[len(got)-1]; len(got) != LinesPerMinute+1 || last["peer"] != peer || last["suppressed"] != float64(flood-LinesPerMinute) {
				t.Errorf("after the window: %d lines, the last %v; want %d, peer %s, suppressed %d", len(got), last, LinesPerMinute+1, peer, flood-LinesPerMinute)
			}
		})
	}
}
