package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// R17.2: /readyz is 200 while the serving certificate is valid and an API
// replica answers its /readyz, and 503 with the reason otherwise; /livez is
// always 200.
func TestReadinessR17_2(t *testing.T) {
	e := newEnv(t)
	up := startHedgeReplica(t, e, "a", "ok")
	down := "https://" + droppingListener(t)
	tests := []struct {
		name     string
		urls     []string
		after    time.Duration // the clock moved past start
		want     int
		wantBody string
	}{
		{"a replica answers", []string{up.srv.URL}, 0, http.StatusOK, "ok"},
		{"one of two answers", []string{down, up.srv.URL}, 0, http.StatusOK, "ok"},
		{"no replica answers", []string{down}, 0, http.StatusServiceUnavailable, "no API replica is reachable"},
		{"certificate expired", []string{up.srv.URL}, 25 * time.Hour, http.StatusServiceUnavailable, "the serving certificate is valid from"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := clock.NewFake(testNow)
			cfg := e.config("")
			cfg.APIURLs = tc.urls
			g, err := New(cfg, Options{Log: quietLog(), Clock: c})
			if err != nil {
				t.Fatal(err)
			}
			defer g.Shutdown(context.Background())
			c.Advance(tc.after)
			srv := httptest.NewServer(g.DiagnosticsHandler())
			defer srv.Close()
			code, body := get(t, srv.URL+"/readyz")
			if code != tc.want || !strings.Contains(body, tc.wantBody) {
				t.Errorf("/readyz = %d %q, want %d containing %q", code, body, tc.want, tc.wantBody)
			}
			if code, _ := get(t, srv.URL+"/livez"); code != http.StatusOK {
				t.Errorf("/livez = %d", code)
			}
		})
	}
}

// R17.1: a join the API's replica never answers is one relay error of
// that upstream; the certificate's seconds to expiry is exported.
func TestRelayErrorMetricsR17_1(t *testing.T) {
	e := newEnv(t)
	down := "https://" + droppingListener(t)
	g, gw := startGateway(t, e.config(down))
	d := newDaemon(t, e, gw)
	defer d.tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := d.client.Join(ctx, connect.NewRequest(&agentv1.JoinRequest{})); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("join: %v, want UNAVAILABLE", err)
	}
	v := telemetrytest.Gather(t, g.Registry())
	if got := v.Get(telemetry.GatewayRelayErrors, telemetry.LabelUpstream, down); got != 1 {
		t.Errorf("relay errors of %s = %v, want 1 (%v)", down, got, v)
	}
	if got := v.Get(telemetry.GatewayCertExpiry); got < 23*3600 || got > 24*3600 {
		t.Errorf("certificate expiry %v s, want about a day", got)
	}
	if got := v.Get(telemetry.GatewaySessionsHeld); got != 0 {
		t.Errorf("sessions held %v, want 0", got)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}
