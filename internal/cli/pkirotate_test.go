package cli_test

import (
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// rotationWorld is a server config on a SQLite file and a fresh PKI.
func rotationWorld(t *testing.T) (env map[string]string, config, pkiDir string) {
	t.Helper()
	dir := t.TempDir()
	pkiDir = filepath.Join(dir, "pki")
	env = map[string]string{"BETTER_COMPUTE_SECRET": "cli-rotation-test-secret-0123456789-abcdefghij"}
	run(t, env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", pkiDir).ok(t)
	config = filepath.Join(dir, "server.toml")
	toml := fmt.Sprintf("[store]\npath = %q\n[pki]\ndir = %q\n", filepath.Join(dir, "bc.db"), pkiDir)
	if err := os.WriteFile(config, []byte(toml), 0o600); err != nil {
		t.Fatal(err)
	}
	return env, config, pkiDir
}

// R16.1: pki rotate walks a key through its phases, pki status and pki
// pins show them, issue-gateway issues from the serving CA in force, and
// phases out of order are refused with the product's codes.
func TestPKIRotateCommandsR16_1(t *testing.T) {
	env, config, pkiDir := rotationWorld(t)
	status := func() map[string]any {
		var out map[string]any
		if err := json.Unmarshal([]byte(run(t, env, "pki", "status", "--config", config, "--json").ok(t).stdout), &out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	if keys := status()["keys"].([]any); len(keys) != len(ca.Kinds)+1 {
		t.Fatalf("status lists %d keys, want every kind and the secret", len(keys))
	}
	out := run(t, env, "pki", "rotate", "serving-ca", "--phase", "prepare", "--config", config).ok(t).stdout
	if !strings.Contains(out, "serving-ca: prepared generation 2") {
		t.Fatalf("prepare said %q", out)
	}
	pins := run(t, env, "pki", "pins", "--config", config).ok(t).stdout
	if !strings.Contains(pins, "serving_ca_spki_pins = [\"sha256/") || strings.Count(strings.SplitN(strings.Split(pins, "serving_ca_spki_pins = ")[1], "\n", 2)[0], "sha256/") != 2 {
		t.Fatalf("pins after prepare: %s", pins)
	}
	run(t, env, "pki", "rotate", "serving-ca", "--phase", "prepare", "--config", config).fails(t, "INVALID_STATE", "prepared already")
	run(t, env, "pki", "rotate", "serving-ca", "--phase", "activate", "--config", config).ok(t)

	// The new gateway certificate chains to the activated serving CA.
	crt := filepath.Join(t.TempDir(), "gw.crt")
	run(t, env, "pki", "issue-gateway", "--san", "gw.example.com", "--config", config, "--cert-out", crt, "--key-out", crt+".key").ok(t)
	data, err := os.ReadFile(crt)
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(data)
	leaf, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	oldPEM, err := os.ReadFile(filepath.Join(pkiDir, ca.FileServingCACert))
	if err != nil {
		t.Fatal(err)
	}
	ob, _ := pem.Decode(oldPEM)
	old, err := x509.ParseCertificate(ob.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if leaf.CheckSignatureFrom(old) == nil || !strings.Contains(leaf.Issuer.CommonName, "generation 2") {
		t.Fatalf("issue-gateway after activate: issued by %q, want the serving CA of generation 2", leaf.Issuer.CommonName)
	}

	// The install script embeds the serving CA in force (R16.2).
	var st map[string]any
	if err := json.Unmarshal([]byte(run(t, env, "pki", "status", "--config", config, "--json").ok(t).stdout), &st); err != nil {
		t.Fatal(err)
	}
	var servingNow string
	for _, k := range st["keys"].([]any) {
		k := k.(map[string]any)
		for _, g := range k["generations"].([]any) {
			if g := g.(map[string]any); k["key"] == "serving-ca" && g["state"] == "current" {
				servingNow = g["fingerprint"].(string)
			}
		}
	}
	script := run(t, env, "daemon", "install-script", "--config", config, "--pool", ids.New(ids.Pool, time.Now()), "--site", ids.New(ids.Site, time.Now()), "--gateway-url", "https://gw.example.com",
		"--base-url", "https://compute.example.com", "--bcd-version", "0.1.0", "--sha256", "amd64="+strings.Repeat("ab", 32)).ok(t).stdout
	if servingNow == "" || !strings.Contains(script, servingNow) {
		t.Fatalf("the install script does not embed the current serving CA pin %q", servingNow)
	}

	run(t, env, "pki", "rotate", "serving-ca", "--phase", "retire", "--config", config).ok(t)
	run(t, env, "pki", "rotate", "serving-ca", "--phase", "retire", "--config", config).fails(t, "INVALID_STATE", "no previous")
	run(t, env, "pki", "rotate", "root-ca", "--phase", "prepare", "--config", config).fails(t, "INVALID_ARGUMENT", "not a key")
	run(t, env, "pki", "rotate", "serving-ca", "--config", config).fails(t, "INVALID_ARGUMENT", "phase")
	run(t, map[string]string{}, "pki", "rotate", "serving-ca", "--phase", "prepare", "--config", config).fails(t, "INVALID_CONFIG", "BETTER_COMPUTE_SECRET")

	// The secret rotates too, and the PKI opens under the new one only.
	next := "cli-rotation-next-secret-0123456789-abcdefghijkl"
	env["BETTER_COMPUTE_NEW_SECRET"] = next
	run(t, env, "pki", "rotate", "secret", "--phase", "prepare", "--config", config).ok(t)
	run(t, env, "pki", "rotate", "secret", "--phase", "activate", "--config", config).ok(t)
	env["BETTER_COMPUTE_SECRET"] = next
	run(t, env, "pki", "rotate", "secret", "--phase", "retire", "--config", config).ok(t)
	if _, err := ca.Load(pkiDir, []byte(next)); err != nil {
		t.Fatalf("the PKI under the new secret: %v", err)
	}
	table := run(t, env, "pki", "status", "--config", config).ok(t).stdout
	for _, want := range []string{"serving-ca       2    current", "serving-ca       1    retired", "secret           2    current"} {
		if !strings.Contains(table, want) {
			t.Fatalf("status lacks %q:\n%s", want, table)
		}
	}
}
