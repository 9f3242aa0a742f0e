package cli_test

import (
	"encoding/pem"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// the CA that verifies the control plane comes from
// --ca-file or, without the flag, from BETTER_COMPUTE_CA_FILE (documented in
// --help). The API is served over real TLS by a CA the system does not
// trust.
func TestCAFileEnv(t *testing.T) {
	e := apitest.Start(t, storetest.OpenSQLite(t), apitest.Options{NoJoin: true})
	srv := httptest.NewTLSServer(e.Server)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	notPEM := filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(notPEM, []byte("junk"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := func(caEnv string) map[string]string {
		m := map[string]string{"BETTER_COMPUTE_URL": srv.URL, "BETTER_COMPUTE_API_KEY": e.AdminKey}
		if caEnv != "" {
			m["BETTER_COMPUTE_CA_FILE"] = caEnv
		}
		return m
	}

	// Without a CA the system roots refuse the server.
	if r := run(t, env(""), "tenants", "list"); r.code != 1 || !strings.Contains(r.stderr, "certificate") {
		t.Fatalf("without a CA: exit %d, stderr %q", r.code, r.stderr)
	}
	// The variable alone is enough.
	if r := run(t, env(ca), "tenants", "list").ok(t); !strings.Contains(r.stdout, "root") {
		t.Fatalf("tenants list:\n%s", r.stdout)
	}
	// The flag wins over the variable, both ways.
	run(t, env(notPEM), "tenants", "list", "--ca-file", ca).ok(t)
	run(t, env(ca), "tenants", "list", "--ca-file", notPEM).fails(t, "INVALID_CONFIG", "holds no PEM certificate")

	help := run(t, nil, "--help").ok(t).stdout
	if !strings.Contains(help, "BETTER_COMPUTE_CA_FILE") {
		t.Fatalf("--help does not document BETTER_COMPUTE_CA_FILE:\n%s", help)
	}
	flagHelp := run(t, nil, "tenants", "list", "--help").ok(t).stdout
	if !strings.Contains(flagHelp, "--ca-file") || !strings.Contains(flagHelp, "$BETTER_COMPUTE_CA_FILE") {
		t.Fatalf("--ca-file help does not name the variable:\n%s", flagHelp)
	}
}
