package export

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// metrics are the exporter's series (telemetry.Export*), labelled by sink
// name, a set the config fixes.
type metrics struct {
	rows   *prometheus.CounterVec
	errors *prometheus.CounterVec
	lag    *prometheus.GaugeVec
}

func newMetrics() *metrics {
	return &metrics{
		rows: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.ExportRows,
			Help: "Events and audit rows a sink acknowledged, by sink and kind (event, audit); a batch resent after a lost acknowledgement counts again."},
			[]string{telemetry.LabelSink, telemetry.LabelKind}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.ExportErrors,
			Help: "Failed deliveries to a sink (refused, timed out, unreachable, or the position not committed), by sink; each is retried after a backoff."},
			[]string{telemetry.LabelSink}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: telemetry.ExportLagSeconds,
			Help: "Seconds since the oldest row a sink has not acknowledged was written (0: caught up, or this replica does not hold the export lease), by sink."},
			[]string{telemetry.LabelSink}),
	}
}

// lagCollector sets each sink's lag from the clock at scrape time, so a
// sink that is down shows its lag growing between attempts.
type lagCollector struct{ e *Exporter }

func (c lagCollector) Describe(ch chan<- *prometheus.Desc) { c.e.m.lag.Describe(ch) }

func (c lagCollector) Collect(ch chan<- prometheus.Metric) {
	now := c.e.cfg.Clock.Now()
	held := c.e.held.Load()
	for _, s := range c.e.sinks {
		lag := 0.0
		if t := s.oldest.Load(); held && t != 0 {
			lag = max(now.Sub(timeOf(t)).Seconds(), 0)
		}
		c.e.m.lag.WithLabelValues(s.name).Set(lag)
	}
	c.e.m.lag.Collect(ch)
}
