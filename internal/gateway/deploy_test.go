package gateway

import (
	"testing"

	"github.com/better-compute/better-compute/internal/shared/manifest"
)

// R18.3: the gateway.toml the gateway's Deployment reads is one the
// gateway accepts (unknown keys refused), with the metrics listener its
// probes ask on every address.
func TestKubernetesGatewayConfigR18_3(t *testing.T) {
	toml, err := manifest.ConfigMapFile("gateway.toml", "control-plane", "configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := ParseConfig([]byte(toml))
	if err != nil {
		t.Fatalf("the gateway refuses the Deployment's gateway.toml: %v\n%s", err, toml)
	}
	if c.Metrics.Listen != ":9465" {
		t.Errorf("metrics listen %q: the Deployment's probes ask :9465", c.Metrics.Listen)
	}
	if c.APIURL != "https://better-compute-agent.better-compute.svc:8444" {
		t.Errorf("api_url %q is not the Service better-compute-agent", c.APIURL)
	}
}
