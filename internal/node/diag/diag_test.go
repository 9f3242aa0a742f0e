package diag

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// R17.2: /readyz says why the node is not ready: no identity, an expired
// certificate, a failed renewal, no session; and 200 once all are well.
// The daemon's hooks move the state and the metrics (R17.1).
func TestReadinessR17_2(t *testing.T) {
	c := clock.NewFake(time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC))
	d := New(&identity.Store{Dir: t.TempDir()}, c.Now)
	srv := httptest.NewServer(d.Handler())
	defer srv.Close()

	ready := func(want string) {
		t.Helper()
		res, err := http.Get(srv.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if want == "" && res.StatusCode != http.StatusOK || want != "" && (res.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), want)) {
			t.Errorf("/readyz = %d %q, want %q", res.StatusCode, b, want)
		}
	}
	ready("no identity")

	id := &identity.Identity{NodeID: "node_1", NotAfter: c.Now().Add(time.Hour)}
	d.load = func() (*identity.Identity, error) { return id, nil }
	ready("no session to the gateway yet")
	d.Welcomed("node_1")
	ready("")

	d.SessionEnded(errors.New("gateway went away"))
	ready("no session to the gateway: gateway went away")
	d.Welcomed("node_1")
	ready("")

	d.RenewalFailed(errors.New("refused"))
	ready("the last renewal failed at 2026-12-02T12:00:00Z: refused")
	d.Renewed(id)
	ready("")

	c.Advance(2 * time.Hour)
	ready("the node certificate expired at 2026-12-02T13:00:00Z")

	v := telemetrytest.Scrape(t, nil, srv.URL+"/metrics")
	for name, want := range map[string]float64{
		telemetry.NodeRenewals + `{outcome="ok"}`:     1,
		telemetry.NodeRenewals + `{outcome="failed"}`: 1,
		telemetry.NodeSessionReconnects:               1,
		telemetry.NodeCertExpiry:                      -3600,
	} {
		if v[name] != want {
			t.Errorf("%s = %v, want %v", name, v[name], want)
		}
	}
}

// R17.1: /metrics is byte for byte what the Prometheus client writes for
// the same metrics and values (metrics.go writes it by hand).
func TestMetricsMatchPrometheusClientR17_1(t *testing.T) {
	c := clock.NewFake(time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC))
	d := New(&identity.Store{Dir: t.TempDir()}, c.Now)
	id := &identity.Identity{NodeID: "node_1", NotAfter: c.Now().Add(90*time.Minute + 250*time.Millisecond)}
	d.load = func() (*identity.Identity, error) { return id, nil }
	d.Welcomed("node_1")
	d.Welcomed("node_1")
	d.Welcomed("node_1")
	d.Renewed(id)
	d.RenewalFailed(errors.New("refused"))
	d.RenewalFailed(errors.New("refused"))

	reg := prometheus.NewRegistry()
	renewals := prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.NodeRenewals, Help: "Certificate renewals by outcome (ok, failed)."}, []string{telemetry.LabelOutcome})
	renewals.WithLabelValues(telemetry.OutcomeOK).Add(1)
	renewals.WithLabelValues(telemetry.OutcomeFailed).Add(2)
	reconnects := prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.NodeSessionReconnects, Help: "Sessions opened after the first (each a reconnect)."})
	reconnects.Add(2)
	expiry := prometheus.NewGauge(prometheus.GaugeOpts{Name: telemetry.NodeCertExpiry, Help: "Seconds until the node certificate expires (negative: expired; absent without an identity)."})
	expiry.Set(5400.25)
	reg.MustRegister(renewals, reconnects, expiry)

	get := func(h http.Handler) (string, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
		return rec.Header().Get("Content-Type"), rec.Body.String()
	}
	wantType, want := get(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	gotType, got := get(d.Handler())
	if got != want || gotType != wantType {
		t.Errorf("/metrics (%s):\n%s\nthe Prometheus client's (%s):\n%s", gotType, got, wantType, want)
	}
}
