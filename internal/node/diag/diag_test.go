package diag

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

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

	v := telemetrytest.Gather(t, d.Registry())
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
