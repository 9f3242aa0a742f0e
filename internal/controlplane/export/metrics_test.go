package export_test

import (
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/controlplane/export"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// R17.1, R17.4: while the sink refuses, every attempt counts as an error
// and its lag is above 0; once it takes the batches, the rows exported are
// exactly the rows written, by kind, and the lag is back to 0.
func TestExportMetricsR17_4(t *testing.T) {
	db := storetest.OpenSQLite(t)
	var down atomic.Bool
	down.Store(true)
	f := &fakeSink{fault: func(int) string {
		if down.Load() {
			return "500"
		}
		return ""
	}}
	srv := newFakeSink(t, f)
	produce(t, db, nil, 7, "ten_a")
	reg := prometheus.NewRegistry()
	const name = "siem"
	start(t, export.Config{DB: db, Codec: codecOf(t, db), BatchSize: 5, Metrics: reg,
		Sinks: []export.SinkConfig{{Kind: "webhook", Name: name, URL: srv.URL}}})
	get := func(metric string, labels ...string) float64 {
		return telemetrytest.Gather(t, reg).Get(metric, append([]string{telemetry.LabelSink, name}, labels...)...)
	}
	waitFor(t, "two failed deliveries and a lag", func() bool {
		return get(telemetry.ExportErrors) >= 2 && get(telemetry.ExportLagSeconds) > 0
	})
	if got := get(telemetry.ExportRows); got != 0 {
		t.Errorf("%v rows exported while the sink refused every batch", got)
	}
	down.Store(false)
	waitFor(t, "caught up", func() bool { return caughtUp(t, db, name) && get(telemetry.ExportLagSeconds) == 0 })
	for _, kind := range []string{export.KindEvent, export.KindAudit} {
		if got := get(telemetry.ExportRows, telemetry.LabelKind, kind); got != 7 {
			t.Errorf("%s rows exported: %v, want 7", kind, got)
		}
	}
	f.mu.Lock()
	refused := f.posts - 2 // two batches taken: 5 events and 5 audit rows, then 2 and 2
	f.mu.Unlock()
	if got := get(telemetry.ExportErrors); got != float64(refused) {
		t.Errorf("%v errors, want the %d refused posts", got, refused)
	}
}
