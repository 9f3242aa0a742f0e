package tpmdevice_test

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
)

// opensslTPM2 returns openssl when its tpm2 provider loads, failing in CI
// (.ci/run installs tpm2-openssl and the swtpm TCTI) and skipping
// elsewhere.
func opensslTPM2(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("openssl")
	if err == nil {
		// The provider needs a TPM to load, so look for its module file.
		if out, err := exec.Command(p, "version", "-m").Output(); err == nil {
			dir := strings.Trim(strings.TrimSpace(strings.TrimPrefix(string(out), "MODULESDIR:")), `"`)
			if _, err := os.Stat(filepath.Join(dir, "tpm2.so")); err == nil {
				return p
			}
		}
	}
	why := "node.key must load in OpenSSL's tpm2 provider: install tpm2-openssl and libtss2-tcti-swtpm0"
	tools.Missing(t, "openssl with the tpm2 provider is missing", why)
	t.Skipf("SKIPPING: openssl with the tpm2 provider is missing (%s)", why)
	return ""
}

// R20.3: node.key, as bcd writes it, loads in OpenSSL's tpm2 provider (its
// parent is the SRK tpm2-openssl derives): the public key it reads is the
// node key's, and a signature it makes in the TPM verifies under it.
func TestOpenSSLLoadsNodeKeyR20_3(t *testing.T) {
	openssl := opensslTPM2(t)
	sim := tpmtest.Start(t)
	tp, err := tpmdevice.OpenSimulator(sim.Addr)
	if err != nil {
		t.Fatal(err)
	}
	k, err := tp.NewNodeKey()
	if err != nil {
		t.Fatal(err)
	}
	rec, err := k.Record()
	if err != nil {
		t.Fatal(err)
	}
	// swtpm serves one connection at a time: OpenSSL's turn.
	if err := tp.Close(); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	keyFile, data, sigFile := filepath.Join(dir, "node.key"), filepath.Join(dir, "data"), filepath.Join(dir, "sig")
	for f, b := range map[string][]byte{keyFile: rec, data: []byte("signed in the TPM by OpenSSL\n")} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env := append(os.Environ(), "TPM2OPENSSL_TCTI="+sim.TCTI())
	run := func(args ...string) []byte {
		t.Helper()
		cmd := exec.Command(openssl, args...)
		cmd.Env = env
		out, err := cmd.Output()
		if err != nil {
			msg := ""
			if ee, ok := err.(*exec.ExitError); ok {
				msg = string(ee.Stderr)
			}
			t.Fatalf("openssl %v: %v\n%s", args, err, msg)
		}
		return out
	}
	pubPEM := run("pkey", "-provider", "tpm2", "-provider", "default", "-in", keyFile, "-pubout")
	block, _ := pem.Decode(pubPEM)
	if block == nil {
		t.Fatalf("openssl printed no public key: %s", pubPEM)
	}
	pub, err := x509.ParsePKIXPublicKey(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if !k.Public().(*ecdsa.PublicKey).Equal(pub) {
		t.Fatal("openssl reads another public key from node.key")
	}
	run("dgst", "-provider", "tpm2", "-provider", "default", "-propquery", "?provider=tpm2", "-sha256", "-sign", keyFile, "-out", sigFile, data)
	sig, err := os.ReadFile(sigFile)
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := os.ReadFile(data)
	sum := sha256.Sum256(msg)
	if !ecdsa.VerifyASN1(pub.(*ecdsa.PublicKey), sum[:], sig) {
		t.Fatal("the signature OpenSSL made with node.key does not verify")
	}
}

// R20.3: a node key made under the SRK of earlier versions still loads and
// signs (bcd tries the standard parent, then that one), and keeps doing so.
func TestLegacyParentKeyStillLoadsR20_3(t *testing.T) {
	sim := tpmtest.Start(t)
	tp := sim.Open(t)
	old, err := tpmdevice.CreateLegacyKey(tp, tpmdevice.NodeKeyTemplate)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := old.Record()
	if err != nil {
		t.Fatal(err)
	}
	k, err := tp.LoadKey(rec)
	if err != nil {
		t.Fatalf("a key under the legacy parent: %v", err)
	}
	for range 2 {
		sum := sha256.Sum256([]byte("still here"))
		sig, err := k.Sign(nil, sum[:], crypto.SHA256)
		if err != nil {
			t.Fatal(err)
		}
		if !ecdsa.VerifyASN1(k.Public().(*ecdsa.PublicKey), sum[:], sig) {
			t.Fatal("signature does not verify")
		}
	}
	if n, err := tp.TransientHandles(); err != nil || n != 0 {
		t.Fatalf("%d transient handles left (%v)", n, err)
	}
}
