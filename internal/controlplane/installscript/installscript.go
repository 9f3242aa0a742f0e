// Package installscript generates the POSIX sh script that installs bcd on a
// brownfield server and joins it (R3.5, R11.5): `better-compute daemon
// install-script`. It owns the script's template, the validation of what goes
// into it, and the shell quoting of every value.
//
// The script carries no secret: the pins and the JoinService encryption key
// are public, and the join token reaches it only at run time, from
// BCD_JOIN_TOKEN or standard input (R11.2), never as an argument or in a URL.
//
// SECURITY: every value is validated here and then single-quoted (Quote)
// before it enters the template, so nothing an operator types can become
// shell syntax. The downloaded binary is trusted only through the SHA-256
// embedded at generation time, never through the transport.
package installscript

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/x509"
	_ "embed"
	"encoding/pem"
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/dnsname"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Arches are the architectures bcd is built for, as the download path and
// --sha256 name them.
var Arches = []string{"amd64", "arm64"}

// DefaultBasePath is the API's default base path.
const DefaultBasePath = wire.DefaultBasePath

// Params is what the script embeds. Validate names each problem by the CLI
// flag that sets it (--pool, --site, …), since the CLI maps flags 1:1.
type Params struct {
	// Pool is the pool the token is for (pool_…); the script names it in
	// its messages. The token decides the pool, not the script.
	Pool string
	// Site is config.toml's site (site_…).
	Site string
	// GatewayURL is config.toml's gateway_url, an https URL.
	GatewayURL string
	// GatewayServerName, optional, is config.toml's gateway_server_name.
	GatewayServerName string
	// BaseURL is the control plane, https://host[:port], without a path.
	BaseURL string
	// BasePath is the API's base path (DefaultBasePath when empty).
	BasePath string
	// Version is the bcd version to download, like 0.1.0.
	Version string
	// SHA256 maps an arch (amd64, arm64) to the hex SHA-256 of its build.
	// At least one arch is required; the script refuses the others.
	SHA256 map[string]string
	// Pins are config.toml's three pins (ca.Bundle.Pins).
	Pins pki.Pins
	// EncryptionKey is the JoinService encryption key, written to
	// join-encryption.jwk. It must match Pins.JoinEncryption.
	EncryptionKey *ecdsa.PublicKey
	// DownloadCA, optional, is PEM of the CA certificates the script
	// trusts for the download instead of the system's (--download-ca-file):
	// for a control plane whose TLS certificate comes from a private CA,
	// such as better-compute dev's bc-dev/ca.pem. It only widens whom the
	// script will talk to; what it installs is still decided by the
	// SHA-256. Only CERTIFICATE blocks are accepted, so a key file given by
	// mistake never ends up in a script.
	DownloadCA []byte

	// allowHTTP lets tests embed an http:// BaseURL (an httptest server).
	// The script still refuses it unless BCD_ALLOW_HTTP=1.
	allowHTTP bool
}

var (
	// versionRE is semver: MAJOR.MINOR.PATCH, an optional -prerelease and
	// +build, in the characters the download route accepts.
	versionRE  = regexp.MustCompile(`^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$`)
	basePathRE = regexp.MustCompile(`^(/[A-Za-z0-9._~-]+)*$`)
	hexRE      = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// maxVersionLen bounds --bcd-version (the download route allows 64).
const maxVersionLen = 64

// ValidVersion reports whether v is a version --bcd-version accepts
// (MAJOR.MINOR.PATCH[-pre][+build], at most 64 characters).
func ValidVersion(v string) bool {
	return len(v) <= maxVersionLen && versionRE.MatchString(v)
}

// maxDownloadCASize bounds --download-ca-file; a CA certificate is about
// 1 KiB.
const maxDownloadCASize = 64 << 10

// DownloadCAPEM checks --download-ca-file's content and returns it as
// canonical PEM: one or more CERTIFICATE blocks that parse, and nothing
// else (no private key, no text between blocks). "" when data is empty.
func DownloadCAPEM(data []byte) (string, error) {
	if len(data) == 0 {
		return "", nil
	}
	if len(data) > maxDownloadCASize {
		return "", errs.Invalid("--download-ca-file", "larger than %d bytes: want the PEM of a CA certificate or two", maxDownloadCASize)
	}
	var out strings.Builder
	rest := data
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			// SECURITY: never embed a key (or anything else) in a script
			// that is meant to be copied around.
			return "", errs.Invalid("--download-ca-file", "holds a %s block: want only CA certificates (PEM CERTIFICATE blocks)", b.Type)
		}
		if _, err := x509.ParseCertificate(b.Bytes); err != nil {
			return "", errs.Invalid("--download-ca-file", "a certificate does not parse: %v", err)
		}
		out.Write(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: b.Bytes}))
	}
	if len(bytes.TrimSpace(rest)) > 0 || out.Len() == 0 {
		return "", errs.Invalid("--download-ca-file", "want the PEM of CA certificates (-----BEGIN CERTIFICATE-----), and nothing else")
	}
	return strings.TrimRight(out.String(), "\n"), nil
}

// ParseSHA256 parses --sha256 values: "amd64=HEX,arm64=HEX", as one value or
// several. Hex is accepted in either case and returned lower case.
func ParseSHA256(values []string) (map[string]string, error) {
	out := map[string]string{}
	for _, v := range values {
		for _, item := range strings.Split(v, ",") {
			item = strings.TrimSpace(item)
			if item == "" {
				continue
			}
			arch, sum, ok := strings.Cut(item, "=")
			if !ok {
				return nil, errs.Invalid("--sha256", "want ARCH=HEX items like amd64=<64 hex>,arm64=<64 hex>")
			}
			arch = strings.TrimSpace(arch)
			if !validArch(arch) {
				return nil, errs.Invalid("--sha256", "unknown arch %q: bcd is built for amd64 and arm64", arch)
			}
			if _, dup := out[arch]; dup {
				return nil, errs.Invalid("--sha256", "%s is given twice", arch)
			}
			out[arch] = strings.ToLower(strings.TrimSpace(sum))
		}
	}
	return out, nil
}

func validArch(a string) bool {
	for _, x := range Arches {
		if a == x {
			return true
		}
	}
	return false
}

// Validate checks every field. The error is errs.InvalidArgument naming the
// flag.
func (p *Params) Validate() error {
	if err := p.ValidateFlags(); err != nil {
		return err
	}
	for _, pin := range []string{p.Pins.ServingCA, p.Pins.JoinSigning, p.Pins.JoinEncryption} {
		if !pki.ValidPin(pin) {
			return errs.Invalid("--pki-dir", "the bundle's pins are not sha256/<base64> pins")
		}
	}
	if p.EncryptionKey == nil || !pki.PinMatches(p.Pins.JoinEncryption, p.EncryptionKey) {
		return errs.Invalid("--pki-dir", "the bundle's join encryption key does not match its pin")
	}
	return nil
}

// ValidateFlags checks what the operator types (every field but Pins and
// EncryptionKey, which come from the bundle), so the CLI reports a typo
// before it asks for the PKI secret.
func (p *Params) ValidateFlags() error {
	if !ids.Valid(ids.Pool, p.Pool) {
		return errs.Invalid("--pool", "want a pool id like pool_01k5w…")
	}
	if !ids.Valid(ids.Site, p.Site) {
		return errs.Invalid("--site", "want a site id like site_01k5w…")
	}
	if msg := checkURL(p.GatewayURL, false, true); msg != "" {
		return errs.Invalid("--gateway-url", "%s", msg)
	}
	if p.GatewayServerName != "" && !dnsname.Valid(p.GatewayServerName) {
		return errs.Invalid("--gateway-server-name", "want a DNS name like gw.eu.example.com (no scheme or port)")
	}
	if msg := checkURL(p.BaseURL, p.allowHTTP, false); msg != "" {
		return errs.Invalid("--base-url", "%s", msg)
	}
	if bp := normalizeBasePath(p.BasePath); !basePathRE.MatchString(bp) || strings.Contains(bp, "/../") || strings.HasSuffix(bp, "/..") || strings.Contains(bp, "/./") || strings.HasSuffix(bp, "/.") {
		return errs.Invalid("--base-path", "want a path like /api/compute (letters, digits, . _ ~ - and /)")
	}
	if !ValidVersion(p.Version) {
		return errs.Invalid("--bcd-version", "want a version like 0.1.0 (MAJOR.MINOR.PATCH[-pre][+build])")
	}
	if len(p.SHA256) == 0 {
		return errs.Invalid("--sha256", "required: amd64=<64 hex>,arm64=<64 hex> (at least one arch)")
	}
	for arch, sum := range p.SHA256 {
		if !validArch(arch) {
			return errs.Invalid("--sha256", "unknown arch %q: bcd is built for amd64 and arm64", arch)
		}
		if !hexRE.MatchString(sum) {
			return errs.Invalid("--sha256", "%s: want 64 hex digits (sha256sum of the build)", arch)
		}
	}
	if _, err := DownloadCAPEM(p.DownloadCA); err != nil {
		return err
	}
	return nil
}

// checkURL returns what is wrong with a scheme://host[:port] URL, or "".
// withPath allows a path (the gateway URL, as bcd does).
func checkURL(s string, allowHTTP, withPath bool) string {
	if s == "" {
		return "required: an https URL"
	}
	u, err := url.Parse(s)
	if err != nil {
		return "not a URL"
	}
	switch {
	case u.Scheme != "https" && !(allowHTTP && u.Scheme == "http"):
		return "want an https:// URL"
	case u.Host == "" || u.Hostname() == "":
		return "want a host"
	case u.User != nil:
		return "must not carry credentials"
	case u.RawQuery != "" || u.Fragment != "" || u.ForceQuery || u.Opaque != "":
		return "must not carry a query or fragment"
	case !withPath && strings.Trim(u.Path, "/") != "":
		return "want scheme://host[:port] only; put the path in --base-path"
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "bad port"
		}
	}
	return ""
}

// normalizeBasePath returns "/a/b" for "a/b/", "" for "/", and
// DefaultBasePath for "".
func normalizeBasePath(bp string) string {
	if bp == "" {
		return DefaultBasePath
	}
	t := strings.Trim(bp, "/")
	if t == "" {
		return ""
	}
	return "/" + t
}

// DownloadURL is where the script fetches bcd for arch (R11.5):
// {base-url}{base-path}/downloads/bcd/{version}/linux-{arch}.
func (p *Params) DownloadURL(arch string) string {
	return p.downloadPrefix() + arch
}

func (p *Params) downloadPrefix() string {
	return strings.TrimRight(p.BaseURL, "/") + normalizeBasePath(p.BasePath) + "/downloads/bcd/" + p.Version + "/linux-"
}

// Quote returns s as one POSIX shell word: single-quoted, each ' written as
// '\”. Inside single quotes nothing is special, so the result is s exactly,
// newlines included. (A NUL cannot live in a shell string; Validate never
// lets one through.)
func Quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Unit is bcd.service. `bcd run` is the long-running daemon; it exits 3
// when the node was retired, which must not restart it (RestartPreventExitStatus).
const Unit = `[Unit]
Description=better-compute node daemon (bcd)
Wants=network-online.target
After=network-online.target

[Service]
Type=notify
ExecStart=/usr/local/bin/bcd run --config /etc/bcd/config.toml
Restart=always
RestartSec=5
RestartPreventExitStatus=3

[Install]
WantedBy=multi-user.target
`

//go:embed install.sh.tmpl
var scriptTemplate string

var tmpl = template.Must(template.New("install.sh").Funcs(template.FuncMap{"sh": Quote}).Parse(scriptTemplate))

// Config returns the config.toml the script writes (R11.1), validated by
// bcd's own config package so bcd can read it.
func (p *Params) Config() ([]byte, error) {
	c := &bcdconfig.Config{
		GatewayURL:           p.GatewayURL,
		GatewayServerName:    p.GatewayServerName,
		Site:                 p.Site,
		ServingCASPKIPin:     p.Pins.ServingCA,
		JoinSigningKeyPin:    p.Pins.JoinSigning,
		JoinEncryptionKeyPin: p.Pins.JoinEncryption,
	}
	data, err := c.Marshal()
	if err != nil {
		return nil, errs.New(errs.InvalidArgument, "the bcd config would not be valid: %s", errs.MessageOf(err))
	}
	return data, nil
}

// JWK returns join-encryption.jwk's content.
func (p *Params) JWK() ([]byte, error) {
	data, err := pki.MarshalEncryptionJWK(p.EncryptionKey)
	if err != nil {
		return nil, err
	}
	return append(data, '\n'), nil
}

// Generate validates p and returns the install script.
func Generate(p Params) ([]byte, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	cfg, err := p.Config()
	if err != nil {
		return nil, err
	}
	jwk, err := p.JWK()
	if err != nil {
		return nil, err
	}
	ca, err := DownloadCAPEM(p.DownloadCA)
	if err != nil {
		return nil, err
	}
	arches := make([]string, 0, len(p.SHA256))
	for a := range p.SHA256 {
		arches = append(arches, a)
	}
	sort.Strings(arches)
	data := struct {
		Pool, Site, Version, DownloadPrefix string
		SHA256AMD64, SHA256ARM64, Arches    string
		Config, JWK, Unit, DownloadCA       string
	}{
		Pool: p.Pool, Site: p.Site, Version: p.Version, DownloadPrefix: p.downloadPrefix(),
		SHA256AMD64: p.SHA256["amd64"], SHA256ARM64: p.SHA256["arm64"], Arches: strings.Join(arches, " "),
		// The script prints these with printf '%s\n'.
		Config:     strings.TrimRight(string(cfg), "\n"),
		JWK:        strings.TrimRight(string(jwk), "\n"),
		Unit:       strings.TrimRight(Unit, "\n"),
		DownloadCA: ca,
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, data); err != nil {
		return nil, errs.Wrap(err, errs.Internal, "render the install script: %v", err)
	}
	return buf.Bytes(), nil
}
