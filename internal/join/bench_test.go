package join_test

import (
	"context"
	"sync/atomic"
	"testing"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/apitest"
	"github.com/better-compute/better-compute/internal/join"
	"github.com/better-compute/better-compute/internal/join/jointest"
	"github.com/better-compute/better-compute/internal/store"
	"github.com/better-compute/better-compute/internal/store/storetest"
)

// machineSeq numbers benchmark machines so every join is a new machine.
var machineSeq atomic.Int64

// BenchmarkJoin admits distinct machines with one many-use token through
// the in-process JoinService (the whole admission transaction, signing and
// the signed answer), serially and from parallel callers, on each store.
// The daemon's side (key, CSR, seal) is made before the timer starts.
func BenchmarkJoin(b *testing.B) {
	for _, d := range []struct {
		name string
		open func(testing.TB) *store.DB
	}{{"sqlite", storetest.OpenSQLite}, {"postgres", storetest.OpenPostgres}} {
		b.Run(d.name, func(b *testing.B) {
			e := apitest.Start(b, d.open(b), apitest.Options{})
			f := newFixture(b, e)
			svc := f.svc
			ctx := context.Background()
			prepare := func(b *testing.B) []*agentv1.JoinRequest {
				tok := f.token(b, &bcv1.CreateJoinTokenRequest{MaxUses: 100000})
				reqs := make([]*agentv1.JoinRequest, b.N)
				for i := range reqs {
					reqs[i] = jointest.NewMachine(b, jointest.Claims(int(machineSeq.Add(1)))).Request(b, e.Bundle, tok.Token, "")
				}
				return reqs
			}
			b.Run("serial", func(b *testing.B) {
				reqs := prepare(b)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if _, err := svc.Join(ctx, reqs[i], join.Peer{}); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "joins/s")
			})
			b.Run("parallel", func(b *testing.B) {
				reqs := prepare(b)
				var next atomic.Int64
				b.SetParallelism(4)
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if _, err := svc.Join(ctx, reqs[next.Add(1)-1], join.Peer{}); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "joins/s")
			})
		})
	}
}
