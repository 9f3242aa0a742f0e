package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// R24.1: bcd join --server against a control plane whose certificate
// comes from a private CA (dev's serving CA, as a production install's
// API certificate from pki issue-gateway): without the CA the refusal
// names --server-ca-file, and with it the host builds its config and
// joins.
func TestJoinServerPrivateCAR24_1(t *testing.T) {
	bc, bcd := binaries(t)
	dir := t.TempDir()
	data := filepath.Join(dir, "bc-dev")
	dev := start(t, nil, bc, "dev", "--data-dir", data, "--listen", "127.0.0.1:0", "--gateway-listen", "127.0.0.1:0")
	waitFor(t, "dev's banner", 60*time.Second, func() bool {
		return strings.Contains(dev.output(), "better-compute dev is running")
	})
	env := readEnv(t, filepath.Join(data, "dev.env"))
	e := envList(env)
	pinsOut, errOut, code := run(t, nil, "", bc, "pki", "pins", "--dir", filepath.Join(data, "pki"), "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	pins := jsonOf(t, pinsOut)
	tokOut, errOut, code := run(t, e, "", bc, "join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "1h", "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	token := jsonOf(t, tokOut)["token"].(string)

	sys := filepath.Join(dir, "sys")
	fakeSysfs(t, sys, "SN-9100", "00112233-4455-6677-8899-aabbccdd9100", "3c:ec:ef:0a:91:00")
	conf := filepath.Join(dir, "etc-bcd", "config.toml")
	join := []string{"join", "--config", conf, "--server", env["BETTER_COMPUTE_URL"],
		"--site", env["SITE"], "--serving-ca-pin", pins["servingCaPin"].(string), "--join-signing-pin", pins["joinSigningKeyPin"].(string),
		"--join-encryption-pin", pins["joinEncryptionKeyPin"].(string), "--data-dir", filepath.Join(dir, "bcd-data"), "--sysfs-root", sys}
	_, errOut, code = run(t, nil, token+"\n", bcd, join...)
	if code == 0 || !strings.Contains(errOut, "unknown authority") || !strings.Contains(errOut, "--server-ca-file") {
		t.Fatalf("bcd join --server with dev's private CA and no CA file: exit %d, %s; want the refusal to name --server-ca-file", code, errOut)
	}
	out, errOut, code := run(t, nil, token+"\n", bcd, append(join, "--server-ca-file", env["BETTER_COMPUTE_CA_FILE"])...)
	if code != 0 || !strings.Contains(errOut, "joined as node_") {
		t.Fatalf("bcd join --server --server-ca-file: exit %d\n%s\n%s", code, out, errOut)
	}
	if _, err := os.Stat(conf); err != nil {
		t.Fatalf("the host build wrote no config: %v", err)
	}
}
