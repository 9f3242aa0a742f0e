package server

import (
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/manifest"
)

// R18.3: the serve.toml the control plane's Deployment reads is one serve
// accepts (it refuses unknown keys, so a key renamed here and not there
// fails this test, not a rollout), on PostgreSQL, with no password in the
// ConfigMap and the metrics listener the probes ask on every address.
func TestKubernetesServeConfigR18_3(t *testing.T) {
	toml, err := manifest.ConfigMapFile("serve.toml", "control-plane", "configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := ParseConfig([]byte(toml))
	if err != nil {
		t.Fatalf("serve refuses the Deployment's serve.toml: %v\n%s", err, toml)
	}
	if c.Store.Driver != "postgres" || !strings.Contains(c.Store.DSN, "passfile=/etc/better-compute/postgres/pgpass") ||
		strings.Contains(c.Store.DSN, "password") || strings.Contains(c.Store.DSN, ":@") {
		t.Errorf("store %+v: want postgres with the password in the Secret's pgpass file", c.Store)
	}
	if c.Metrics.Listen != ":9090" || c.Metrics.Pprof {
		t.Errorf("metrics %+v: the Deployment's probes ask :9090, without pprof", c.Metrics)
	}
	for _, f := range []string{c.TLS.CertFile, c.TLS.KeyFile, c.Agent.CertFile, c.Agent.KeyFile, c.PKI.Dir} {
		if !strings.HasPrefix(f, "/etc/better-compute/") {
			t.Errorf("%s is not under the Secrets' mounts", f)
		}
	}
}
