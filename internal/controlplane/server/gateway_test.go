package server

import (
	"testing"

	"github.com/better-compute/better-compute/internal/gateway"
)

// [gateway] listen runs the gateway in serve's process with the gateway's
// own keys and rules; the keys that name an agent listener are refused,
// and so are gateway keys without listen. R17.2 (its [gateway.metrics]).
func TestInProcessGatewayConfig(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n[pki]\ndir = \"/tmp/pki\"\n"
	gw := "[gateway]\nurl = \"https://gw.example.com\"\nlisten = \":443\"\ncert_file = \"/etc/gw.crt\"\nkey_file = \"/etc/gw.key\"\n"
	for _, c := range []struct {
		name, toml, err string
	}{
		{name: "published only", toml: base + "[gateway]\nurl = \"https://gw.example.com\"\n"},
		{name: "in process", toml: base + gw + "max_sessions = 7\n[gateway.metrics]\nlisten = \"127.0.0.1:9465\"\n"},
		{name: "api_url", toml: base + gw + "api_url = \"https://api:8444\"\n", err: "gateway.api_url: is not used by a gateway in the API's process"},
		{name: "api_ca_file", toml: base + gw + "api_ca_file = \"/ca.pem\"\n", err: "gateway.api_ca_file: is not used"},
		{name: "its own log", toml: base + gw + "[gateway.log]\nformat = \"json\"\n", err: "gateway.log: a gateway in the API's process logs with the API's [log]"},
		{name: "no key", toml: base + "[gateway]\nlisten = \":443\"\ncert_file = \"/etc/gw.crt\"\n", err: "gateway.key_file: is required"},
		{name: "keys without listen", toml: base + "[gateway]\ncert_file = \"/etc/gw.crt\"\n", err: "gateway.listen is required to run the gateway in this process"},
		{name: "no pki", toml: "[store]\npath = \"/tmp/bc.db\"\n" + gw, err: "gateway.listen needs pki.dir"},
		{name: "unknown key", toml: base + gw + "bogus = 1\n", err: "unknown keys: gateway.bogus"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if c.name == "in process" && (!cfg.Gateway.InProcess() || cfg.Gateway.MaxSessions != 7 || cfg.Gateway.Metrics.Listen != "127.0.0.1:9465" ||
				cfg.Gateway.MaxConcurrent != gateway.DefaultMaxConcurrent) {
				t.Errorf("gateway config %+v", cfg.Gateway)
			}
			if c.name == "published only" && cfg.Gateway.InProcess() {
				t.Error("a published url alone runs a gateway")
			}
		})
	}
}
