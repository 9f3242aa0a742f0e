package e2e

import (
	"path/filepath"
	"testing"
)

// e2eSecret is the BETTER_COMPUTE_SECRET of the e2e tests: a generated
// one, since pki init refuses secrets estimated below 128 bits.
const e2eSecret = "u4Kx8Qm2Zr7Lc0Vn5Jb9Tf3Wh6Yd1Ps8Ag2Ne7Ro4Ci"

// initPKI runs pki init in dir/pki and issues the gateway's and the agent
// listener's certificates (dir/gateway.crt, dir/agent.crt and their keys),
// as an operator would; it returns the environment that names the PKI and
// its secret, and the pins (pki pins --json).
func initPKI(t *testing.T, bc, dir string) ([]string, map[string]any) {
	t.Helper()
	secretEnv := []string{"BETTER_COMPUTE_SECRET=" + e2eSecret, "BETTER_COMPUTE_PKI_DIR=" + filepath.Join(dir, "pki")}
	if _, errOut, code := run(t, secretEnv, "", bc, "pki", "init", "--trust-domain", "compute.example.com"); code != 0 {
		t.Fatal(errOut)
	}
	for _, name := range []string{"gateway", "agent"} {
		if _, errOut, code := run(t, secretEnv, "", bc, "pki", "issue-gateway", "--san", "127.0.0.1", "--cert-out", filepath.Join(dir, name+".crt"), "--key-out", filepath.Join(dir, name+".key")); code != 0 {
			t.Fatal(errOut)
		}
	}
	pinsOut, errOut, code := run(t, secretEnv, "", bc, "pki", "pins", "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	return secretEnv, jsonOf(t, pinsOut)
}
