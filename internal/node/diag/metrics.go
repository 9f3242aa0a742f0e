package diag

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// bcd's three metrics are written in the Prometheus text format here
// rather than with the Prometheus client: its registry, collectors and
// encoders would be about a megabyte of a binary that runs on every
// machine, for three numbers. diag_test.go reads them back with the
// Prometheus parser.

// metricsContentType is the text format's media type, version 0.0.4, as
// the Prometheus client names it (names need no escaping: they are ASCII).
const metricsContentType = "text/plain; version=0.0.4; charset=utf-8; escaping=underscores"

// serveMetrics is /metrics: the families sorted by name, each series of a
// family by label value, as the Prometheus client writes them.
func (d *Diag) serveMetrics(w http.ResponseWriter, _ *http.Request) {
	// Seconds until the node certificate expires; 0 without an identity,
	// so that the expiry alert (below an hour) fires for such a node too.
	expiry := 0.0
	if id, err := d.load(); err == nil {
		expiry = id.NotAfter.Sub(d.now()).Seconds()
	}
	d.mu.Lock()
	ok, failed, reconnects := d.renewedOK, d.renewFailures, d.reconnects
	d.mu.Unlock()

	w.Header().Set("Content-Type", metricsContentType)
	family(w, telemetry.NodeCertExpiry, "gauge", "Seconds until the node certificate expires (negative: expired; absent without an identity).")
	fmt.Fprintf(w, "%s %s\n", telemetry.NodeCertExpiry, strconv.FormatFloat(expiry, 'g', -1, 64))
	family(w, telemetry.NodeRenewals, "counter", "Certificate renewals by outcome (ok, failed).")
	fmt.Fprintf(w, "%s{%s=%q} %d\n", telemetry.NodeRenewals, telemetry.LabelOutcome, telemetry.OutcomeFailed, failed)
	fmt.Fprintf(w, "%s{%s=%q} %d\n", telemetry.NodeRenewals, telemetry.LabelOutcome, telemetry.OutcomeOK, ok)
	family(w, telemetry.NodeSessionReconnects, "counter", "Sessions opened after the first (each a reconnect).")
	fmt.Fprintf(w, "%s %d\n", telemetry.NodeSessionReconnects, reconnects)
}

// family writes a metric family's HELP and TYPE lines.
func family(w http.ResponseWriter, name, typ, help string) {
	fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
}
