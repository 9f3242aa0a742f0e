package cli_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/cli"
	"github.com/better-compute/better-compute/internal/controlplane/installscript"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// daemonRun runs the CLI in-process with env as its whole environment.
func daemonRun(env map[string]string, args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = cli.Main(context.Background(), args, cli.Env{
		Stdin: strings.NewReader(""), Stdout: &out, Stderr: &errb,
		Getenv: func(k string) string { return env[k] },
	})
	return code, out.String(), errb.String()
}

var daemonErrLine = regexp.MustCompile(`^Error: ([A-Z_]+): (.+)\n$`)

func hexOf(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// R3.5: daemon install-script validates every flag (INVALID_ARGUMENT naming
// it) before it reads the bundle, then prints the script with the bundle's
// pins and encryption key.
func TestDaemonInstallScript(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	env := map[string]string{"BETTER_COMPUTE_SECRET": "Zq3v9W1xKc7TbN4mYp0sLr8hJd2fGu6eAo5iQt1wXyE"}
	if code, _, stderr := daemonRun(env, "pki", "init", "--trust-domain", "compute.example.com", "--dir", dir); code != 0 {
		t.Fatalf("pki init: %s", stderr)
	}
	_, pinsOut, _ := daemonRun(env, "pki", "pins", "--dir", dir, "--json")
	var pins map[string]string
	if err := json.Unmarshal([]byte(pinsOut), &pins); err != nil {
		t.Fatal(err)
	}

	now := time.Now()
	pool, site := ids.New(ids.Pool, now), ids.New(ids.Site, now)
	a, b := hexOf("amd64 build"), hexOf("arm64 build")
	flags := map[string]string{
		"--pool": pool, "--site": site, "--gateway-url": "https://gw.eu.example.com",
		"--base-url": "https://compute.example.com", "--bcd-version": "0.1.0",
		"--sha256": "amd64=" + a + ",arm64=" + b, "--pki-dir": dir,
	}
	args := func(edit map[string]string) []string {
		out := []string{"daemon", "install-script"}
		for k, v := range flags {
			if e, ok := edit[k]; ok {
				if e == "<omit>" {
					continue
				}
				v = e
			}
			out = append(out, k, v)
		}
		for k, v := range edit {
			if _, ok := flags[k]; !ok {
				out = append(out, k, v)
			}
		}
		return out
	}

	for _, c := range []struct {
		edit map[string]string
		code string
		want string
	}{
		{map[string]string{"--pool": "<omit>"}, "INVALID_ARGUMENT", "--pool: required"},
		{map[string]string{"--pool": site}, "INVALID_ARGUMENT", "--pool"},
		{map[string]string{"--site": "site_'x"}, "INVALID_ARGUMENT", "--site"},
		{map[string]string{"--gateway-url": "http://gw.eu.example.com"}, "INVALID_ARGUMENT", "--gateway-url"},
		{map[string]string{"--gateway-server-name": "gw;id"}, "INVALID_ARGUMENT", "--gateway-server-name"},
		{map[string]string{"--base-url": "ftp://compute.example.com"}, "INVALID_ARGUMENT", "--base-url"},
		{map[string]string{"--base-path": "/a/../b"}, "INVALID_ARGUMENT", "--base-path"},
		{map[string]string{"--bcd-version": "latest"}, "INVALID_ARGUMENT", "--bcd-version"},
		{map[string]string{"--sha256": "<omit>"}, "INVALID_ARGUMENT", "--sha256"},
		{map[string]string{"--sha256": "amd64=abc"}, "INVALID_ARGUMENT", "--sha256: amd64: want 64 hex"},
		{map[string]string{"--sha256": "386=" + a}, "INVALID_ARGUMENT", "--sha256: unknown arch"},
		{map[string]string{"--pki-dir": filepath.Join(dir, "missing")}, "", ""},
	} {
		code, stdout, stderr := daemonRun(env, args(c.edit)...)
		if c.code == "" {
			if code == 0 {
				t.Errorf("%v: succeeded", c.edit)
			}
			continue
		}
		m := daemonErrLine.FindStringSubmatch(stderr)
		if code != 1 || stdout != "" || m == nil || m[1] != c.code || !strings.Contains(m[2], c.want) {
			t.Errorf("%v: exit %d, stderr %q; want %s %q", c.edit, code, stderr, c.code, c.want)
		}
	}

	// A flag error is reported before the secret is needed.
	if _, _, stderr := daemonRun(map[string]string{}, args(map[string]string{"--bcd-version": "x"})...); !strings.Contains(stderr, "INVALID_ARGUMENT: --bcd-version") {
		t.Fatalf("stderr %q", stderr)
	}
	// the script holds only public values, and making
	// it needs no secret.
	if code, noSecretScript, stderr := daemonRun(map[string]string{}, args(nil)...); code != 0 || !strings.Contains(noSecretScript, pins["joinEncryptionKeyPin"]) {
		t.Fatalf("without a secret: exit %d %q", code, stderr)
	}
	// The token is never an argument, here either.
	if code, _, _ := daemonRun(env, append(args(nil), "bcjt_jt_x.y")...); code == 0 {
		t.Fatal("accepted an argument")
	}

	code, script, stderr := daemonRun(env, args(map[string]string{"--gateway-server-name": "gw.internal.example.com", "--base-path": "/compute/"})...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{
		"#!/bin/sh\n", "set -euC\n",
		"BCD_POOL=" + installscript.Quote(pool) + "\n",
		"BCD_URL_PREFIX='https://compute.example.com/compute/downloads/bcd/0.1.0/linux-'\n",
		"BCD_SHA256_AMD64='" + a + "'\n", "BCD_SHA256_ARM64='" + b + "'\n",
		"serving_ca_spki_pin = \"" + pins["servingCaPin"] + "\"",
		"join_signing_key_pin = \"" + pins["joinSigningKeyPin"] + "\"",
		"join_encryption_key_pin = \"" + pins["joinEncryptionKeyPin"] + "\"",
		"gateway_server_name = \"gw.internal.example.com\"",
		`"kty":"EC"`,
	} {
		if !strings.Contains(script, want) {
			t.Errorf("script lacks %q", want)
		}
	}
	if strings.Contains(script, `"d":`) {
		t.Fatal("the script carries a private key")
	}
}
