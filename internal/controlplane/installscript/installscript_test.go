package installscript

import (
	"crypto/sha256"
	"encoding/hex"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// testShell is dash when present (the strictest common /bin/sh), else sh.
func testShell(t testing.TB) string {
	t.Helper()
	if p, err := exec.LookPath("dash"); err == nil {
		return p
	}
	return tools.Need(t, "sh", "the install script is a POSIX shell script")
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// validParams returns Params that pass Validate, with a fresh bundle.
func validParams(t testing.TB) Params {
	t.Helper()
	b, err := ca.Generate("compute.example.com", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	pins, err := b.Pins()
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	return Params{
		Pool:          ids.New(ids.Pool, now),
		Site:          ids.New(ids.Site, now),
		GatewayURL:    "https://gw.eu.example.com",
		BaseURL:       "https://compute.example.com",
		Version:       "0.1.0",
		SHA256:        map[string]string{"amd64": sum([]byte("a")), "arm64": sum([]byte("b"))},
		Pins:          pins,
		EncryptionKey: &b.JoinEncryptionKey.PublicKey,
	}
}

// R3.5: Quote makes one shell word whose value is the input exactly.
func TestQuote(t *testing.T) {
	sh := testShell(t)
	for _, v := range []string{
		"", "plain", "it's", "'", "''", `"double"`, `a'b"c`, "$HOME", "`id`", "$(id)",
		`back\slash\`, "new\nline\n", "tab\tand space", "; rm -rf / #", "*?[a]~", "!x", "-n", "é\u00e9",
	} {
		q := Quote(v)
		out, err := exec.Command(sh, "-c", "printf '%s' "+q).Output()
		if err != nil {
			t.Fatalf("%q: %v", v, err)
		}
		if string(out) != v {
			t.Errorf("Quote(%q) = %s: the shell read %q", v, q, out)
		}
	}
}

// R3.5: every flag is validated, and the error names it.
func TestValidateFlags(t *testing.T) {
	cases := []struct {
		name string
		edit func(p *Params)
		flag string
	}{
		{"pool missing", func(p *Params) { p.Pool = "" }, "--pool"},
		{"pool is a site", func(p *Params) { p.Pool = p.Site }, "--pool"},
		{"pool quoted", func(p *Params) { p.Pool = "pool_'; id" }, "--pool"},
		{"site bad", func(p *Params) { p.Site = "site_x" }, "--site"},
		{"gateway http", func(p *Params) { p.GatewayURL = "http://gw.example.com" }, "--gateway-url"},
		{"gateway creds", func(p *Params) { p.GatewayURL = "https://u:p@gw.example.com" }, "--gateway-url"},
		{"gateway query", func(p *Params) { p.GatewayURL = "https://gw.example.com/?x=1" }, "--gateway-url"},
		{"gateway no host", func(p *Params) { p.GatewayURL = "https:///x" }, "--gateway-url"},
		{"server name port", func(p *Params) { p.GatewayServerName = "gw.example.com:443" }, "--gateway-server-name"},
		{"server name quote", func(p *Params) { p.GatewayServerName = "gw'.example.com" }, "--gateway-server-name"},
		{"base http", func(p *Params) { p.BaseURL = "http://compute.example.com" }, "--base-url"},
		{"base with path", func(p *Params) { p.BaseURL = "https://compute.example.com/api" }, "--base-url"},
		{"base fragment", func(p *Params) { p.BaseURL = "https://compute.example.com#x" }, "--base-url"},
		{"base bad port", func(p *Params) { p.BaseURL = "https://compute.example.com:99999" }, "--base-url"},
		{"base path dotdot", func(p *Params) { p.BasePath = "/api/../x" }, "--base-path"},
		{"base path quote", func(p *Params) { p.BasePath = "/api'x" }, "--base-path"},
		{"base path space", func(p *Params) { p.BasePath = "/a b" }, "--base-path"},
		{"version missing", func(p *Params) { p.Version = "" }, "--bcd-version"},
		{"version v", func(p *Params) { p.Version = "v0.1.0" }, "--bcd-version"},
		{"version short", func(p *Params) { p.Version = "0.1" }, "--bcd-version"},
		{"version slash", func(p *Params) { p.Version = "0.1.0/../x" }, "--bcd-version"},
		{"version long", func(p *Params) { p.Version = "0.1.0-" + strings.Repeat("a", 64) }, "--bcd-version"},
		{"sha none", func(p *Params) { p.SHA256 = nil }, "--sha256"},
		{"sha short", func(p *Params) { p.SHA256 = map[string]string{"amd64": "abc"} }, "--sha256"},
		{"sha upper", func(p *Params) { p.SHA256 = map[string]string{"amd64": strings.ToUpper(sum(nil))} }, "--sha256"},
		{"sha arch", func(p *Params) { p.SHA256 = map[string]string{"riscv64": sum(nil)} }, "--sha256"},
		{"pins", func(p *Params) { p.Pins.JoinSigning = "x" }, "--pki-dir"},
		{"key mismatch", func(p *Params) { p.Pins.JoinEncryption = p.Pins.JoinSigning }, "--pki-dir"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := validParams(t)
			c.edit(&p)
			err := p.Validate()
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != c.flag {
				t.Fatalf("err = %v, want INVALID_ARGUMENT on %s", err, c.flag)
			}
			if _, err := Generate(p); err == nil {
				t.Fatal("Generate accepted it")
			}
		})
	}
	for _, ok := range []func(p *Params){
		func(p *Params) {},
		func(p *Params) { p.BasePath = "/" },
		func(p *Params) { p.BasePath = "compute/" },
		func(p *Params) { p.BaseURL = "https://compute.example.com:8443/" },
		func(p *Params) { p.Version = "1.2.3-rc.1+build.5" },
		func(p *Params) { p.SHA256 = map[string]string{"arm64": sum(nil)} },
		func(p *Params) { p.GatewayServerName = "gw.eu.example.com" },
	} {
		p := validParams(t)
		ok(&p)
		if err := p.Validate(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
}

func TestParseSHA256(t *testing.T) {
	a, b := sum([]byte("a")), sum([]byte("b"))
	got, err := ParseSHA256([]string{"amd64=" + strings.ToUpper(a) + ", arm64=" + b})
	if err != nil || got["amd64"] != a || got["arm64"] != b || len(got) != 2 {
		t.Fatalf("got %v, %v", got, err)
	}
	if got, err := ParseSHA256([]string{"amd64=" + a, "arm64=" + b}); err != nil || len(got) != 2 {
		t.Fatalf("repeated flag: %v, %v", got, err)
	}
	for _, bad := range [][]string{{"amd64"}, {"x86_64=" + a}, {"amd64=" + a + ",amd64=" + b}} {
		if _, err := ParseSHA256(bad); !errs.Is(err, errs.InvalidArgument) {
			t.Errorf("%v: %v", bad, err)
		}
	}
}

// R11.5: the download URL is {base-url}{base-path}/downloads/bcd/{version}/linux-{arch}.
func TestDownloadURL(t *testing.T) {
	p := validParams(t)
	if got, want := p.DownloadURL("amd64"), "https://compute.example.com/api/compute/downloads/bcd/0.1.0/linux-amd64"; got != want {
		t.Fatalf("%s, want %s", got, want)
	}
	p.BaseURL, p.BasePath = "https://c.example.com/", "/"
	if got, want := p.DownloadURL("arm64"), "https://c.example.com/downloads/bcd/0.1.0/linux-arm64"; got != want {
		t.Fatalf("%s, want %s", got, want)
	}
}

// The generated script parses in the shell, and every embedded value is
// quoted.
func TestGenerateSyntax(t *testing.T) {
	p := validParams(t)
	p.GatewayServerName = "gw.eu.example.com"
	out, err := Generate(p)
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	for _, want := range []string{
		"#!/bin/sh\n", "set -euC\n",
		"BCD_VERSION='0.1.0'\n",
		"BCD_SITE='" + p.Site + "'\n",
		"BCD_URL_PREFIX='https://compute.example.com/api/compute/downloads/bcd/0.1.0/linux-'\n",
		"BCD_SHA256_AMD64='" + p.SHA256["amd64"] + "'\n",
		"gateway_server_name = \"gw.eu.example.com\"",
		"join_encryption_key_pin = \"" + p.Pins.JoinEncryption + "\"",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("script lacks %q", want)
		}
	}
	cmd := exec.Command(testShell(t), "-n")
	cmd.Stdin = strings.NewReader(s)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sh -n: %v\n%s", err, out)
	}
}
