package gateway

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// R15.4: anyone who reaches the gateway can send it a compressed body; it
// takes none. A gzip bomb within max_body_bytes (60 KiB inflating to
// 60 MiB) is refused UNIMPLEMENTED before a byte of it is read, on the
// binary relay, the JSON relay and sessions, and nothing reaches the API.
func TestGatewayRefusesGzipBomb(t *testing.T) {
	e := newEnv(t)
	f := newFakeAPI(t, e)
	g, err := New(e.config(f.URL()), Options{Log: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.LoadX509KeyPair(e.certFile, e.keyFile)
	if err != nil {
		t.Fatal(err)
	}
	h, read := wiretest.CountBody(g.Handler())
	srv := httptest.NewUnstartedServer(h)
	srv.EnableHTTP2 = true
	srv.TLS = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequestClientCert}
	srv.StartTLS()
	defer srv.Close()
	hc := &http.Client{Transport: &http.Transport{ForceAttemptHTTP2: true, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: e.roots}}}
	defer hc.CloseIdleConnections()
	bomb := wiretest.GzipBomb(t, 60<<20)
	tests := []struct{ name, path, contentType string }{
		{"join, binary relay", agentv1connect.JoinServiceJoinProcedure, "application/grpc"},
		{"join, JSON relay", agentv1connect.JoinServiceJoinProcedure, "application/grpc+json"},
		{"renew, binary relay", agentv1connect.JoinServiceRenewProcedure, "application/grpc"},
		{"session", agentv1connect.SessionServiceConnectProcedure, "application/grpc"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := read.Load()
			c := wiretest.RawCall{Path: tc.path, Protocol: "grpc", ContentType: tc.contentType, Gzip: true, Body: bomb}
			if got := c.Do(t, hc, srv.URL); got != "grpc-status 12" {
				t.Errorf("answer %q, want grpc-status 12 (UNIMPLEMENTED)", got)
			}
			if n := read.Load() - before; n > 0 {
				t.Errorf("the gateway read %d body bytes, want none", n)
			}
		})
	}
	if n := f.count(); n != 0 {
		t.Errorf("the API got %d calls, want none", n)
	}
}
