package cli_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/better-compute/better-compute/internal/gateway"
)

// R24.1: gateway --print-config, which docs/operations/configure.md and
// docs/gateway.md tell an operator to run, prints a config the gateway
// loads.
func TestGatewayPrintConfigR24_1(t *testing.T) {
	out := run(t, nil, "gateway", "--print-config").ok(t).stdout
	if out != gateway.Example {
		t.Fatalf("gateway --print-config printed:\n%s", out)
	}
	p := filepath.Join(t.TempDir(), "gateway.toml")
	if err := os.WriteFile(p, []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := gateway.LoadConfig(p); err != nil {
		t.Fatalf("the printed config does not load: %v", err)
	}
}
