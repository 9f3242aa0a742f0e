package store_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// BenchmarkTx runs the smallest transactions of each kind on each dialect:
// a read transaction of one row, and a write transaction of one update. It
// reports cpu-us/op, the test process's CPU per transaction (the engine's
// side; PostgreSQL's backends are not in it).
func BenchmarkTx(b *testing.B) {
	for _, d := range []struct {
		name string
		open func(testing.TB) *store.DB
	}{{"sqlite", storetest.OpenSQLite}, {"postgres", storetest.OpenPostgres}} {
		b.Run(d.name, func(b *testing.B) {
			db := d.open(b)
			ctx := context.Background()
			id := ids.New(ids.Tenant, time.Now())
			if err := db.WithTx(ctx, func(tx *store.Tx) error {
				_, err := tx.InsertTenant(ctx, id, "bench")
				return err
			}); err != nil {
				b.Fatal(err)
			}
			b.Run("read", func(b *testing.B) {
				start := processCPU(b)
				for b.Loop() {
					if err := db.ReadTx(ctx, func(tx *store.Tx) error {
						_, err := tx.GetTenant(ctx, id)
						return err
					}); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64((processCPU(b)-start).Microseconds())/float64(b.N), "cpu-us/op")
			})
			b.Run("write", func(b *testing.B) {
				start := processCPU(b)
				for b.Loop() {
					if err := db.SetClockOffset(ctx, 0); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64((processCPU(b)-start).Microseconds())/float64(b.N), "cpu-us/op")
			})
		})
	}
}

func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
