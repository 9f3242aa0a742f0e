package apimetrics

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// Counting an admitted join and timing its phases allocate nothing once
// the series exists.
func TestJoinCountingAllocatesNothing(t *testing.T) {
	m := NewAPI(prometheus.NewRegistry())
	m.Join("join-token", "node", telemetry.OutcomeAdmitted, "")
	if n := testing.AllocsPerRun(1000, func() {
		m.Join("join-token", "node", telemetry.OutcomeAdmitted, "")
		m.Phase(telemetry.PhaseAdmit, time.Millisecond)
		m.TokenSpent()
	}); n != 0 {
		t.Errorf("%v allocations per join, want 0", n)
	}
}

func BenchmarkJoinCounting(b *testing.B) {
	m := NewAPI(prometheus.NewRegistry())
	for b.Loop() {
		m.Join("join-token", "node", telemetry.OutcomeAdmitted, "")
		m.Phase(telemetry.PhaseCheck, time.Millisecond)
		m.Phase(telemetry.PhaseAdmit, time.Millisecond)
		m.TokenSpent()
		m.Issued("node")
	}
}
