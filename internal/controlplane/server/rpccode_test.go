package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/v1/bcv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

type keyed struct {
	key  string
	next http.RoundTripper
}

func (k keyed) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	if k.key != "" {
		r.Header.Set("Authorization", "Bearer "+k.key)
	}
	return k.next.RoundTrip(r)
}

// R20.4: the code label of an operator call is its RPC code in every
// protocol (Connect, gRPC, gRPC-Web), at the base path and at the root
// path: a gRPC error is an HTTP 200, which the label used to count as
// success. Other routes keep the HTTP status.
func TestMetricsCodeLabelR20_4(t *testing.T) {
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{})
	reqs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "reqs"}, []string{"path", "code"})
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "dur"}, []string{"path"})
	ts := httptest.NewUnstartedServer(instrument(e.Server, e.Server.RouteLabel, reqs, dur))
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(ts.Close)

	const get = "/bettercompute.v1.TenantService/GetTenant"
	tests := []struct {
		name, base, key string
		opt             []connect.ClientOption
		tenant          string
		want            string
	}{
		{"connect ok", "/api/compute", e.AdminKey, nil, e.RootTenant, "ok"},
		{"connect unauthenticated", "/api/compute", "", nil, e.RootTenant, "unauthenticated"},
		{"connect not found", "/api/compute", e.AdminKey, nil, "tn_nope", "not_found"},
		{"grpc ok", "", e.AdminKey, []connect.ClientOption{connect.WithGRPC()}, e.RootTenant, "ok"},
		{"grpc unauthenticated", "", "", []connect.ClientOption{connect.WithGRPC()}, e.RootTenant, "unauthenticated"},
		{"grpc not found", "/api/compute", e.AdminKey, []connect.ClientOption{connect.WithGRPC()}, "tn_nope", "not_found"},
		{"grpc-web unauthenticated", "", "", []connect.ClientOption{connect.WithGRPCWeb()}, e.RootTenant, "unauthenticated"},
		{"grpc-web ok", "", e.AdminKey, []connect.ClientOption{connect.WithGRPCWeb()}, e.RootTenant, "ok"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			hc := &http.Client{Transport: keyed{key: tt.key, next: ts.Client().Transport}}
			c := bcv1connect.NewTenantServiceClient(hc, ts.URL+tt.base, tt.opt...)
			_, err := c.GetTenant(context.Background(), connect.NewRequest(&bcv1.GetTenantRequest{TenantId: tt.tenant}))
			if (tt.want == "ok") != (err == nil) {
				t.Fatalf("GetTenant: %v, want %s", err, tt.want)
			}
			before := count(t, reqs.WithLabelValues(get, tt.want))
			_, _ = c.GetTenant(context.Background(), connect.NewRequest(&bcv1.GetTenantRequest{TenantId: tt.tenant}))
			if after := count(t, reqs.WithLabelValues(get, tt.want)); after != before+1 {
				t.Errorf("code=%q went from %v to %v, want one more", tt.want, before, after)
			}
		})
	}
	// Routes that are not procedures keep the HTTP status.
	res, err := ts.Client().Get(ts.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if n := count(t, reqs.WithLabelValues("GET /healthz", "200")); n != 1 {
		t.Errorf("GET /healthz code=200: %v", n)
	}
}

// count reads a counter's value.
func count(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// The codes read from a Connect stream's end and gRPC-Web trailers.
func TestCodeFromStreamEnds(t *testing.T) {
	frame := func(flags byte, payload string) []byte {
		return append([]byte{flags, 0, 0, byte(len(payload) >> 8), byte(len(payload))}, payload...)
	}
	for _, tt := range []struct {
		name string
		got  string
		want string
	}{
		{"connect end ok", connectEndStreamCode(frame(2, `{}`)), "ok"},
		{"connect end error", connectEndStreamCode(frame(2, `{"error":{"code":"permission_denied"}}`)), "permission_denied"},
		{"connect not an end", connectEndStreamCode(frame(0, `{}`)), "unknown"},
		{"connect garbage", connectEndStreamCode([]byte("x")), "unknown"},
		{"connect unknown code", connectEndStreamCode(frame(2, `{"error":{"code":"zzz"}}`)), "unknown"},
		{"grpc-web trailers", grpcWebTrailerCode(frame(0x80, "grpc-status: 5\r\ngrpc-message: x\r\n")), "not_found"},
		{"grpc-web ok", grpcWebTrailerCode(frame(0x80, "grpc-status: 0\r\n")), "ok"},
		{"grpc code out of range", grpcCodeName("99"), "unknown"},
		{"connect end after messages", connectEndStreamCode(append(frame(0, `{"a":1}`), frame(2, `{"error":{"code":"aborted"}}`)...)), "aborted"},
	} {
		if tt.got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, tt.got, tt.want)
		}
	}
}

// R20.4: without tls.cert_file the operator listener speaks HTTP/2 in
// cleartext (prior knowledge), as grpcurl -plaintext does, and a gRPC call
// at the root path is answered (here refused for want of a key).
func TestPlaintextHTTP2R20_4(t *testing.T) {
	dir := t.TempDir()
	r := start(t, Config{Listen: "127.0.0.1:0", RootTenant: "root", Store: store.Config{Driver: "sqlite", Path: filepath.Join(dir, "bc.db")}}, Options{})
	h2c := &http.Protocols{}
	h2c.SetUnencryptedHTTP2(true)
	hc := &http.Client{Transport: &http.Transport{Protocols: h2c}}
	c := bcv1connect.NewTenantServiceClient(hc, "http://"+r.api, connect.WithGRPC())
	_, err := c.ListTenants(context.Background(), connect.NewRequest(&bcv1.ListTenantsRequest{}))
	if connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "API key") {
		t.Fatalf("gRPC over h2c at the root path: %v, want UNAUTHENTICATED", err)
	}
}
