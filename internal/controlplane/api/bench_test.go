package api_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// BenchmarkCreateJoinToken creates tokens through the Go client over HTTP
// against the in-process server (R2.2: one transaction with the token row,
// its event and its audit row), serially and from parallel callers, on each
// store.
func BenchmarkCreateJoinToken(b *testing.B) {
	for _, d := range []struct {
		name string
		open func(testing.TB) *store.DB
	}{{"sqlite", storetest.OpenSQLite}, {"postgres", storetest.OpenPostgres}} {
		b.Run(d.name, func(b *testing.B) {
			e := apitest.Start(b, d.open(b), apitest.Options{NoJoin: true})
			site := mkSite(b, e.Admin, e.RootTenant, "bench")
			pool := mkPool(b, e.Admin, e.RootTenant, site.Id, "bench", "bcd")
			// Keep connections for every parallel caller: the default
			// transport keeps two idle connections per host.
			tr := http.DefaultTransport.(*http.Transport).Clone()
			tr.MaxIdleConnsPerHost = 256
			c, err := client.New(client.Config{URL: e.URL, APIKey: e.AdminKey, HTTPClient: &http.Client{Transport: tr, Timeout: time.Minute}})
			if err != nil {
				b.Fatal(err)
			}
			req := func() *bcv1.CreateJoinTokenRequest {
				return &bcv1.CreateJoinTokenRequest{TenantId: e.RootTenant, PoolId: pool.Id, TtlSeconds: 3600, Expect: &bcv1.Expect{Serial: "SN-BENCH"}}
			}
			ctx := context.Background()
			b.Run("serial", func(b *testing.B) {
				for b.Loop() {
					if _, err := c.JoinTokens.CreateJoinToken(ctx, rq(req())); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
			})
			b.Run("parallel", func(b *testing.B) {
				b.SetParallelism(4)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if _, err := c.JoinTokens.CreateJoinToken(ctx, rq(req())); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
			})
		})
	}
}
