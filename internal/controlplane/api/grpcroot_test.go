package api_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"

	"connectrpc.com/connect"
	connectv2 "connectrpc.com/connect/v2"
	"connectrpc.com/connect/v2/connecthttp"
	"connectrpc.com/grpcreflect/v2"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/v1/bcv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
)

// bearer adds an API key to every request, as grpcurl -H does.
type bearer struct {
	key  string
	next http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.key)
	return b.next.RoundTrip(r)
}

// h2Server serves e's API over TLS with HTTP/2, as gRPC needs.
func h2Server(t *testing.T, e *apitest.Env) *httptest.Server {
	t.Helper()
	ts := httptest.NewUnstartedServer(e.Server)
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(ts.Close)
	return ts
}

// R20.4: the way grpcurl works: server reflection at the root path lists
// the operator services and describes them, and a method called over gRPC
// at the root path (no base path) answers with an API key.
func TestGRPCRootReflectionR20_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ts := h2Server(t, e)
		hc := &http.Client{Transport: bearer{key: e.AdminKey, next: ts.Client().Transport}}

		rc := grpcreflect.NewClient(connectv2.NewClient(connecthttp.NewTransport(hc, ts.URL, connecthttp.WithGRPC())))
		stream := rc.NewStream(context.Background())
		t.Cleanup(func() { _ = stream.Close() })
		names, err := stream.ListServices()
		if err != nil {
			t.Fatalf("ListServices: %v", err)
		}
		for _, want := range []string{"bettercompute.v1.TenantService", "bettercompute.v1.NodeService", "bettercompute.v1.CommandService", grpcreflect.ReflectV1ServiceName} {
			if !slices.ContainsFunc(names, func(n protoreflect.FullName) bool { return string(n) == want }) {
				t.Errorf("services %v lack %s", names, want)
			}
		}
		files, err := stream.FileContainingSymbol("bettercompute.v1.TenantService")
		if err != nil || !slices.ContainsFunc(files, func(f *descriptorpb.FileDescriptorProto) bool { return f.GetName() == "bettercompute/v1/api.proto" }) {
			t.Fatalf("FileContainingSymbol: %d files, %v", len(files), err)
		}

		tenants := bcv1connect.NewTenantServiceClient(hc, ts.URL, connect.WithGRPC())
		got, err := tenants.GetTenant(context.Background(), connect.NewRequest(&bcv1.GetTenantRequest{TenantId: e.RootTenant}))
		if err != nil {
			t.Fatalf("GetTenant at the root path: %v", err)
		}
		if got.Msg.GetId() != e.RootTenant {
			t.Errorf("tenant %s, want %s", got.Msg.GetId(), e.RootTenant)
		}
	})
}

// R20.4: authentication at the root path is the base path's: without a key
// (or with a wrong one) a call, and reflection, is refused UNAUTHENTICATED
// with the same message.
func TestGRPCRootAuthenticationR20_4(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ts := h2Server(t, e)
		for _, tt := range []struct {
			name string
			hc   *http.Client
		}{
			{"no key", ts.Client()},
			{"wrong key", &http.Client{Transport: bearer{key: "bck_nope", next: ts.Client().Transport}}},
		} {
			t.Run(tt.name, func(t *testing.T) {
				req := &bcv1.GetTenantRequest{TenantId: e.RootTenant}
				_, rootErr := bcv1connect.NewTenantServiceClient(tt.hc, ts.URL, connect.WithGRPC()).GetTenant(context.Background(), connect.NewRequest(req))
				_, baseErr := bcv1connect.NewTenantServiceClient(tt.hc, ts.URL+api.DefaultBasePath, connect.WithGRPC()).GetTenant(context.Background(), connect.NewRequest(req))
				var root, base *connect.Error
				if !errors.As(rootErr, &root) || !errors.As(baseErr, &base) {
					t.Fatalf("root %v, base %v: want connect errors", rootErr, baseErr)
				}
				if root.Code() != connect.CodeUnauthenticated || root.Code() != base.Code() || root.Message() != base.Message() {
					t.Errorf("root path: %v; base path: %v", root, base)
				}

				rc := grpcreflect.NewClient(connectv2.NewClient(connecthttp.NewTransport(tt.hc, ts.URL, connecthttp.WithGRPC())))
				stream := rc.NewStream(context.Background())
				defer stream.Close()
				_, err := stream.ListServices()
				if connectv2.CodeOf(err) != connectv2.CodeUnauthenticated {
					t.Errorf("reflection: %v, want UNAUTHENTICATED", err)
				}
			})
		}
	})
}
