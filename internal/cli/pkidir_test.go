package cli_test

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/ids"
)

var encPinLine = regexp.MustCompile(`join_encryption_key_pin = "(sha256/[^"]+)"`)

func encPin(t *testing.T, out string) string {
	t.Helper()
	m := encPinLine.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no join_encryption_key_pin in:\n%s", out)
	}
	return m[1]
}

// R24.1: after the join-encryption key rotated, the --dir and --pki-dir
// forms hand out the key in force, read from the database beside the PKI
// directory, not the retired first generation the directory keeps; and a
// directory with no database beside it says which command reads the keys
// in force.
func TestPKIDirFormsAfterRotationR24_1(t *testing.T) {
	env, config, pkiDir := rotationWorld(t)
	first := encPin(t, run(t, env, "pki", "pins", "--dir", pkiDir).ok(t).stdout)
	for _, phase := range []string{"prepare", "activate", "retire"} {
		run(t, env, "pki", "rotate", "join-encryption", "--phase", phase, "--config", config).ok(t)
	}
	inForce := run(t, env, "pki", "pins", "--config", config).ok(t).stdout
	if strings.Contains(inForce, "[") {
		t.Fatalf("pki pins --config prints one-element sets as arrays:\n%s", inForce)
	}
	now := encPin(t, inForce)
	if now == first {
		t.Fatal("the rotation did not change the join encryption key")
	}
	dirPins := run(t, env, "pki", "pins", "--dir", pkiDir).ok(t)
	if got := encPin(t, dirPins.stdout); got != now {
		t.Fatalf("pki pins --dir after rotation: %s, want the key in force %s (retired: %s)", got, now, first)
	}
	script := run(t, env, "daemon", "install-script", "--pki-dir", pkiDir, "--pool", ids.New(ids.Pool, time.Now()), "--site", ids.New(ids.Site, time.Now()),
		"--gateway-url", "https://gw.example.com", "--base-url", "https://compute.example.com", "--bcd-version", "0.1.0",
		"--sha256", "amd64="+strings.Repeat("ab", 32)).ok(t).stdout
	if !strings.Contains(script, now) || strings.Contains(script, first) {
		t.Fatalf("install-script --pki-dir embeds the retired key, or not the one in force %s", now)
	}

	// A gateway certificate issued with --dir chains to the serving CA in
	// force, not the directory's retired one.
	for _, phase := range []string{"prepare", "activate"} {
		run(t, env, "pki", "rotate", "serving-ca", "--phase", phase, "--config", config).ok(t)
	}
	crt := filepath.Join(t.TempDir(), "gw.crt")
	run(t, env, "pki", "issue-gateway", "--san", "gw.example.com", "--dir", pkiDir, "--cert-out", crt, "--key-out", crt+".key").ok(t)
	if issuer := issuerCN(t, crt); !strings.Contains(issuer, "generation 2") {
		t.Fatalf("issue-gateway --dir after the serving CA rotated: issued by %q, want generation 2", issuer)
	}

	// A PKI directory alone cannot know of rotations: it says so and
	// names the command that can.
	alone := filepath.Join(t.TempDir(), "pki")
	run(t, env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", alone).ok(t)
	r := run(t, env, "pki", "pins", "--dir", alone).ok(t)
	if !strings.Contains(r.stderr, "pki pins --config") {
		t.Fatalf("pki pins --dir without a database beside it: stderr %q, want the --config form named", r.stderr)
	}
}

func issuerCN(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return leaf.Issuer.CommonName
}
