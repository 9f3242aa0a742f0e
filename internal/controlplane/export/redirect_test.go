package export_test

import (
	"encoding/pem"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/controlplane/export"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/telemetry/telemetrytest"
)

// R23.1: a webhook sink at https, pinned by ca_file, that answers 307 to
// http or to another https host gets no batch through: the exporter never
// follows the redirect, so the target is never asked (no batch, no bearer
// secret), and each attempt counts as a failed delivery whose log says why.
func TestWebhookRedirectNotFollowedR23_1(t *testing.T) {
	db := storetest.OpenSQLite(t)
	var hits atomic.Int64 // requests any redirect target received
	count := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { hits.Add(1) })
	plain := httptest.NewServer(count)
	t.Cleanup(plain.Close)
	other := httptest.NewTLSServer(count) // chains to the same CA as the sink
	t.Cleanup(other.Close)
	var redirects atomic.Int64
	sinkSrv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		redirects.Add(1)
		to := plain.URL
		if strings.HasSuffix(r.URL.Path, "/to-https") {
			to = other.URL
		}
		http.Redirect(w, r, to+"/steal", http.StatusTemporaryRedirect)
	}))
	t.Cleanup(sinkSrv.Close)
	dir := t.TempDir()
	ca, secret := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "token")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: sinkSrv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(secret, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var logged strings.Builder
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return logged.Write(p)
	}), nil))
	produce(t, db, nil, 3, "ten_a")
	reg := prometheus.NewRegistry()
	sinks := []string{"to-http", "to-https"}
	var cfgs []export.SinkConfig
	for _, name := range sinks {
		cfgs = append(cfgs, export.SinkConfig{Kind: "webhook", Name: name, URL: sinkSrv.URL + "/" + name, CAFile: ca, SecretFile: secret})
	}
	start(t, export.Config{DB: db, Codec: codecOf(t, db), Metrics: reg, Log: log, Sinks: cfgs})
	get := func(metric, sink string) float64 {
		return telemetrytest.Gather(t, reg).Get(metric, telemetry.LabelSink, sink)
	}
	for _, name := range sinks {
		waitFor(t, name+": two failed deliveries", func() bool { return get(telemetry.ExportErrors, name) >= 2 })
		if got := get(telemetry.ExportRows, name); got != 0 {
			t.Errorf("%s: %v rows counted as exported through a redirect", name, got)
		}
		if caughtUp(t, db, name) {
			t.Errorf("%s: position committed past rows only a redirect answered", name)
		}
	}
	if n := hits.Load(); n != 0 {
		t.Fatalf("the redirect targets received %d requests", n)
	}
	if redirects.Load() < 4 {
		t.Fatalf("the sink answered %d requests, want at least 4", redirects.Load())
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(logged.String(), "redirects are never followed") {
		t.Fatalf("no failed delivery says why:\n%s", logged.String())
	}
}
