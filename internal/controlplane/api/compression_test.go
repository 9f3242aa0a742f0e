package api_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/wire/wiretest"
)

// bombInflated is what the gzip bomb inflates to: its ~1 MB body fits the
// operator API's 1 MiB limit.
const bombInflated = 990 << 20

// R15.4: an unauthenticated caller cannot make the operator API do work
// beyond the key check: a gzip bomb (1 MB inflating to 990 MiB) or a plain
// message of almost 1 MiB without a key is refused UNAUTHENTICATED before
// a byte of its body is read. With a key, compressed requests are refused
// (UNIMPLEMENTED, compression is off) without reading them either, so
// nothing is ever inflated; a plain request is served.
func TestOperatorAPIRefusesGzipBomb(t *testing.T) {
	db := storetest.OpenSQLite(t)
	e := apitest.Start(t, db, apitest.Options{NoJoin: true})
	bomb := wiretest.GzipBomb(t, bombInflated)
	big := []byte(`{"pageSize": 1, "pageToken": "` + strings.Repeat("x", 900<<10) + `"}`)
	tests := []struct {
		name     string
		call     wiretest.RawCall
		want     string
		maxBytes int64 // body bytes the server may read
	}{
		{"connect, no key, gzip bomb", wiretest.RawCall{Protocol: "connect", Gzip: true, Body: bomb}, "unauthenticated", 0},
		{"grpc, no key, gzip bomb", wiretest.RawCall{Protocol: "grpc", Gzip: true, Body: bomb}, "grpc-status 16", 0},
		{"connect, no key, 900 KiB message", wiretest.RawCall{Protocol: "connect", Body: big}, "unauthenticated", 0},
		{"connect, wrong key, gzip bomb", wiretest.RawCall{Protocol: "connect", Key: "bck_key_01k5w0000000000000000000aa." + strings.Repeat("A", 43), Gzip: true, Body: bomb}, "unauthenticated", 0},
		{"connect, key, gzip bomb", wiretest.RawCall{Protocol: "connect", Key: e.AdminKey, Gzip: true, Body: bomb}, "unimplemented", 0},
		{"grpc, key, gzip bomb", wiretest.RawCall{Protocol: "grpc", Key: e.AdminKey, Gzip: true, Body: bomb}, "grpc-status 12", 0},
		{"connect, no key, unknown procedure, gzip bomb", wiretest.RawCall{Path: "/api/compute/bettercompute.v1.TenantService/Nope", Protocol: "connect", Gzip: true, Body: bomb}, "404 Not Found", 0},
		{"connect, key, plain", wiretest.RawCall{Protocol: "connect", Key: e.AdminKey, Body: []byte(`{"pageSize": 1}`)}, "200 OK", 1 << 10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			h, read := wiretest.CountBody(e.Server)
			srv := httptest.NewUnstartedServer(h)
			srv.EnableHTTP2 = true
			srv.StartTLS()
			defer srv.Close()
			if got := tc.call.Do(t, srv.Client(), srv.URL); got != tc.want {
				t.Errorf("answer %q, want %q", got, tc.want)
			}
			if n := read.Load(); n > tc.maxBytes {
				t.Errorf("the server read %d body bytes, want at most %d", n, tc.maxBytes)
			}
		})
	}
}

// R15.4: the agent listener (where gateways relay joins and sessions) takes
// no compressed request: a gzip bomb within its 64 KiB limit (inflating to
// 60 MiB) from a gateway is refused UNIMPLEMENTED unread, on JoinService
// and on SessionService, on either HTTP/2 server of the listener ([agent]
// http2: a compressed session is not one the callbacks take, so the
// connect handler refuses it there too). A gateway is authenticated (mTLS)
// but not trusted.
func TestAgentListenerRefusesGzipBomb(t *testing.T) {
	db := storetest.OpenSQLite(t)
	e := apitest.Start(t, db, apitest.Options{})
	bomb := wiretest.GzipBomb(t, 60<<20)
	hc := &http.Client{Transport: apitest.GatewayTransport(t, e.Bundle)}
	for _, transport := range apitest.AgentTransports {
		for _, path := range []string{agentv1connect.JoinServiceJoinProcedure, agentv1connect.SessionServiceConnectProcedure} {
			t.Run(transport+path, func(t *testing.T) {
				h, read := wiretest.CountBody(e.Server.AgentHandler())
				var url string
				if transport == apitest.AgentFramer {
					url = apitest.StartFramer(t, e.Server.AgentStreams(h), e.Bundle)
				} else {
					url = apitest.StartAgent(t, h, e.Bundle).URL
				}
				if got := (wiretest.RawCall{Path: path, Protocol: "grpc", Gzip: true, Body: bomb}).Do(t, hc, url); got != "grpc-status 12" {
					t.Errorf("answer %q, want grpc-status 12 (UNIMPLEMENTED)", got)
				}
				if n := read.Load(); n > 0 {
					t.Errorf("the agent listener read %d body bytes, want none", n)
				}
			})
		}
	}
}
