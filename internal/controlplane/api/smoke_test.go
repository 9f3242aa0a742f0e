package api_test

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// R2.1, R2.3: a token is created once with its secret, then listed without.
func TestSmokeTokenCreateList(t *testing.T) {
	apitest.Each(t, apitest.Options{}, func(t *testing.T, e *apitest.Env) {
		ctx := context.Background()
		site, err := e.Admin.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: e.RootTenant, Name: "eu-1"}))
		if err != nil {
			t.Fatal(err)
		}
		pool, err := e.Admin.Pools.CreatePool(ctx, connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: e.RootTenant, SiteId: site.Msg.Id, Name: "gpu", Agent: "bcd"}))
		if err != nil {
			t.Fatal(err)
		}
		tok, err := e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, TtlSeconds: 3600,
			Expect: &bcv1.Expect{Serial: "SN-7701"}, IdempotencyKey: "adopt-rack-b7-u12"}))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(tok.Msg.Token, "bcjt_jt_") || tok.Msg.UsesLeft != 1 || tok.Msg.Role != "node" {
			t.Fatalf("created = %v", tok.Msg)
		}
		list, err := e.Admin.JoinTokens.ListJoinTokens(ctx, connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id}))
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Msg.Items) != 1 || list.Msg.Items[0].Token != "" {
			t.Fatalf("list = %v", list.Msg)
		}
		_, err = e.Admin.JoinTokens.CreateJoinToken(ctx, connect.NewRequest(&bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Msg.Id, TtlSeconds: 59}))
		if ee, ok := errs.As(err); !ok || ee.Code != errs.InvalidArgument || ee.Field != "ttlSeconds" {
			t.Fatalf("ttl 59: %v", err)
		}
		bad := e.Client(t, "bck_key_nope.x")
		_, err = bad.Tenants.ListTenants(ctx, connect.NewRequest(&bcv1.ListTenantsRequest{}))
		if !errs.Is(err, errs.Unauthenticated) {
			t.Fatalf("bad key: %v", err)
		}
	})
}
