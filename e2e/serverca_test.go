package e2e

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// R24.1: bcd join --server against a control plane whose certificate
// comes from a private CA (dev's serving CA, as a production install's
// API certificate from pki issue-gateway). The well-known document is
// trusted through the pins alone: without a CA file the host builds its
// config and joins, a document whose key matches no pin is refused all
// the same, and --server-ca-file, when given, must name the CA the
// certificate comes from.
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
	token := func() string {
		out, errOut, code := run(t, e, "", bc, "join-tokens", "create", "--tenant", env["TENANT"], "--pool", env["POOL"], "--ttl", "1h", "--json")
		if code != 0 {
			t.Fatal(errOut)
		}
		return jsonOf(t, out)["token"].(string)
	}
	join := func(name, encPin string, extra ...string) []string {
		sys := filepath.Join(dir, name, "sys")
		fakeSysfs(t, sys, "SN-"+name, "00112233-4455-6677-8899-aabbccdd"+name, "3c:ec:ef:0a:"+name[:2]+":"+name[2:])
		return append([]string{"join", "--config", filepath.Join(dir, name, "etc-bcd", "config.toml"), "--server", env["BETTER_COMPUTE_URL"],
			"--site", env["SITE"], "--serving-ca-pin", pins["servingCaPin"].(string), "--join-signing-pin", pins["joinSigningKeyPin"].(string),
			"--join-encryption-pin", encPin, "--data-dir", filepath.Join(dir, name, "bcd-data"), "--sysfs-root", sys}, extra...)
	}
	encPin := pins["joinEncryptionKeyPin"].(string)

	tok := token()
	// A document whose encryption key is not the pinned one: refused, TLS
	// or not.
	_, errOut, code = run(t, nil, tok+"\n", bcd, join("9100", pins["joinSigningKeyPin"].(string))...)
	if code == 0 || !strings.Contains(errOut, "does not match join_encryption_key_pin") {
		t.Fatalf("bcd join --server with a pin the document's key does not match: exit %d, %s; want the pin refusal", code, errOut)
	}
	// A CA file the certificate does not come from: the chain is checked.
	_, errOut, code = run(t, nil, tok+"\n", bcd, join("9100", encPin, "--server-ca-file", otherCA(t, dir))...)
	if code == 0 || !strings.Contains(errOut, "unknown authority") || !strings.Contains(errOut, "--server-ca-file") {
		t.Fatalf("bcd join --server --server-ca-file OTHER-CA: exit %d, %s; want the refusal to name --server-ca-file", code, errOut)
	}
	// No CA file: the pins alone vouch for the document.
	out, errOut, code := run(t, nil, tok+"\n", bcd, join("9100", encPin)...)
	if code != 0 || !strings.Contains(errOut, "joined as node_") {
		t.Fatalf("bcd join --server (private CA, no CA file): exit %d\n%s\n%s", code, out, errOut)
	}
	if _, err := os.Stat(filepath.Join(dir, "9100", "etc-bcd", "config.toml")); err != nil {
		t.Fatalf("the host build wrote no config: %v", err)
	}
	// The right CA file: the chain verifies and the join goes through.
	out, errOut, code = run(t, nil, token()+"\n", bcd, join("9101", encPin, "--server-ca-file", env["BETTER_COMPUTE_CA_FILE"])...)
	if code != 0 || !strings.Contains(errOut, "joined as node_") {
		t.Fatalf("bcd join --server --server-ca-file: exit %d\n%s\n%s", code, out, errOut)
	}
}

// otherCA writes a self-signed CA certificate no control plane uses and
// returns its file.
func otherCA(t *testing.T, dir string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "another CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	must(t, err)
	f := filepath.Join(dir, "other-ca.pem")
	must(t, os.WriteFile(f, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644))
	return f
}
