// Package bcdconfig owns the format of bcd's configuration: /etc/bcd/config.toml
// (R11.1) and the JoinService encryption key beside it, join-encryption.jwk.
// It parses, defaults, validates and writes them; it does not fetch anything
// (the well-known fallback of R11.1 and R11.3 belongs to the join). It lives
// in shared because two processes write these files and one reads them: bcd
// reads and rewrites them, the control plane's install script and
// `better-compute dev` write them, so they agree on one definition. What bcd
// does with its pins at run time (learning rotated keys) is node/config's.
//
// The file is TOML and unknown keys are errors, so a misspelt key never
// silently falls back to a default. Every error is errs.InvalidConfig and
// names the key it is about.
//
// SECURITY: the three pin sets are the daemon's only trust anchors. Nothing
// here accepts a key or a gateway without comparing it with a pin, and a
// set gains a key only through a statement signed by a key it already holds
// (Pins, LearnStatements, R16.2).
package bcdconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/dnsname"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	tracing "github.com/better-compute/better-compute/internal/shared/tracing/lite"

	"github.com/BurntSushi/toml"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Defaults and well-known names.
const (
	// DefaultPath is where bcd reads its configuration unless --config says
	// otherwise.
	DefaultPath = "/etc/bcd/config.toml"
	// DefaultDataDir holds the node's identity.
	DefaultDataDir = "/var/lib/bcd"
	// DefaultSysfsRoot and DefaultProcfsRoot are where claims are read.
	DefaultSysfsRoot  = "/sys"
	DefaultProcfsRoot = "/proc"
	// DefaultTPMDevice is the kernel's TPM resource manager.
	DefaultTPMDevice = "/dev/tpmrm0"
	// EncryptionKeyFile is the JoinService encryption key, beside
	// config.toml.
	EncryptionKeyFile = "join-encryption.jwk"

	// maxConfigSize bounds config.toml; a real one is a few hundred bytes.
	maxConfigSize = 64 << 10
	// maxJWKFileSize bounds join-encryption.jwk, as pki does.
	maxJWKFileSize = 4 << 10
)

// TPMMode says whether bcd uses a TPM for its node key (R9.1).
type TPMMode string

// TPM modes.
const (
	// TPMAuto makes the node key in the TPM when one opens, else in
	// software. It is the default.
	TPMAuto TPMMode = "auto"
	// TPMOff never touches a TPM.
	TPMOff TPMMode = "off"
	// TPMRequired fails when no TPM opens.
	TPMRequired TPMMode = "required"
)

// TPM is the optional [tpm] table.
type TPM struct {
	// Device is the TPM character device; DefaultTPMDevice unless Simulator
	// is set.
	Device string `toml:"device,omitempty"`
	// Simulator is a swtpm command port, host:port. When set it is used
	// instead of Device (tests, development).
	Simulator string `toml:"simulator,omitempty"`
	// Mode is auto (default), off or required.
	Mode TPMMode `toml:"mode,omitempty"`
}

// Config is bcd's configuration. Load returns it with defaults applied;
// keys marked optional may be empty in a Config built by hand, and
// ApplyDefaults fills them.
type Config struct {
	// GatewayURL is the regional gateway, an https URL (R11.1).
	GatewayURL string `toml:"gateway_url"`
	// GatewayServerName, optional, is the TLS server name to verify when it
	// differs from the URL's host (the well-known gateway.serverName).
	GatewayServerName string `toml:"gateway_server_name,omitempty"`
	// Site is the site the node joins, site_….
	Site string `toml:"site"`
	// ServingCASPKIPin pins the CA of the gateway's serving certificate.
	ServingCASPKIPin string `toml:"serving_ca_spki_pin"`
	// JoinSigningKeyPin pins the key that signs JoinResponse.
	JoinSigningKeyPin string `toml:"join_signing_key_pin"`
	// JoinEncryptionKeyPin pins the key the join token is sealed to.
	JoinEncryptionKeyPin string `toml:"join_encryption_key_pin"`
	// ServingCASPKIPins, JoinSigningKeyPins and JoinEncryptionKeyPins are
	// the pin sets (R16.2), oldest first. The effective set of a kind is
	// its array plus its singular key when the array lacks it (PinSet); when
	// bcd learns a key it writes both, the singular naming the newest, so
	// an older bcd that reads only the singular keys still works.
	ServingCASPKIPins     []string `toml:"serving_ca_spki_pins,omitempty"`
	JoinSigningKeyPins    []string `toml:"join_signing_key_pins,omitempty"`
	JoinEncryptionKeyPins []string `toml:"join_encryption_key_pins,omitempty"`
	// RetiredPins are the keys bcd saw retired or rolled back by a key it
	// pinned (R21.3), newest last, at most MaxRetiredPins: no statement
	// pins one of them again. bcd writes it; an operator never needs to.
	RetiredPins []string `toml:"retired_pins,omitempty"`
	// DataDir holds the identity; DefaultDataDir when empty.
	DataDir string `toml:"data_dir,omitempty"`
	// SysfsRoot and ProcfsRoot are where claims are read; tests point them
	// at fake trees.
	SysfsRoot  string `toml:"sysfs_root,omitempty"`
	ProcfsRoot string `toml:"procfs_root,omitempty"`
	// TPM configures the TPM; the zero value means auto on DefaultTPMDevice.
	TPM TPM `toml:"tpm,omitempty"`
	// Diagnostics serves /livez, /readyz and /metrics ([diagnostics]
	// listen = "127.0.0.1:9464"; off by default, loopback only unless
	// allow_non_loopback).
	Diagnostics Diagnostics `toml:"diagnostics,omitempty"`
	// Log is bcd run's log format and level ([log] format = "json").
	Log telemetry.LogConfig `toml:"log,omitempty"`
	// Tracing exports OpenTelemetry traces of bcd's calls to the gateway
	// ([tracing] otlp_endpoint); off by default.
	Tracing tracing.Config `toml:"tracing,omitempty"`
}

// ApplyDefaults fills the optional keys that are empty.
func (c *Config) ApplyDefaults() {
	if c.DataDir == "" {
		c.DataDir = DefaultDataDir
	}
	if c.SysfsRoot == "" {
		c.SysfsRoot = DefaultSysfsRoot
	}
	if c.ProcfsRoot == "" {
		c.ProcfsRoot = DefaultProcfsRoot
	}
	if c.TPM.Mode == "" {
		c.TPM.Mode = TPMAuto
	}
	if c.TPM.Device == "" && c.TPM.Simulator == "" {
		c.TPM.Device = DefaultTPMDevice
	}
}

// Load reads, defaults and validates the configuration at path. A missing
// file is an error that matches fs.ErrNotExist (errors.Is), so `bcd join
// --server` can tell "no config.toml" (R11.3) from a broken one.
func Load(path string) (*Config, error) {
	data, err := readBounded(path, maxConfigSize)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: %w", errs.New(errs.InvalidConfig, "no bcd config at %s: install bcd with its install script, or join with bcd join --server", path), fs.ErrNotExist)
		}
		return nil, errs.Wrap(err, errs.InvalidConfig, "cannot read the bcd config: %v", err)
	}
	c, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes config.toml's content, applies defaults and validates it.
// Unknown keys are an error naming them.
func Parse(data []byte) (*Config, error) {
	var c Config
	md, err := toml.NewDecoder(bytes.NewReader(data)).Decode(&c)
	if err != nil {
		// The parse error says where (line, column); the file holds no
		// secrets, so it may be shown.
		return nil, errs.Wrap(err, errs.InvalidConfig, "not valid TOML: %v", err)
	}
	if undecoded := md.Undecoded(); len(undecoded) > 0 {
		keys := make([]string, len(undecoded))
		for i, k := range undecoded {
			keys[i] = k.String()
		}
		return nil, errs.New(errs.InvalidConfig, "unknown key %s", strings.Join(keys, ", "))
	}
	c.ApplyDefaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// Validate checks every key. The error is errs.InvalidConfig; its message
// lists each problem as "<key>: <what is wrong>". Validate does not apply
// defaults: call ApplyDefaults first on a hand-built Config.
func (c *Config) Validate() error {
	var problems []string
	bad := func(key, format string, args ...any) {
		problems = append(problems, key+": "+fmt.Sprintf(format, args...))
	}

	if err := c.Tracing.Validate(); err != nil {
		problems = append(problems, errs.MessageOf(err))
	}
	if p := c.Diagnostics.Problem(); p != "" {
		bad("diagnostics.listen", "%s", p)
	}
	if msg := checkGatewayURL(c.GatewayURL); msg != "" {
		bad("gateway_url", "%s", msg)
	}
	if c.GatewayServerName != "" && !dnsname.Valid(c.GatewayServerName) {
		bad("gateway_server_name", "want a DNS name like gw.eu.example.com (no scheme or port)")
	}
	switch {
	case c.Site == "":
		bad("site", "required: the site id, site_…")
	case !ids.Valid(ids.Site, c.Site):
		bad("site", "want a site id like site_01k5w…")
	}
	for _, p := range []struct {
		key, val string
		set      []string
	}{
		{"serving_ca_spki_pin", c.ServingCASPKIPin, c.ServingCASPKIPins},
		{"join_signing_key_pin", c.JoinSigningKeyPin, c.JoinSigningKeyPins},
		{"join_encryption_key_pin", c.JoinEncryptionKeyPin, c.JoinEncryptionKeyPins},
	} {
		switch {
		case p.val == "" && len(p.set) == 0:
			bad(p.key, "required: a pin sha256/<base64 of the SHA-256 of the SPKI>")
		case p.val != "" && !pki.ValidPin(p.val):
			bad(p.key, "want sha256/<base64 of a SHA-256> (44 characters after sha256/)")
		}
		for i, v := range p.set {
			if !pki.ValidPin(v) {
				bad(fmt.Sprintf("%ss[%d]", p.key, i), "want sha256/<base64 of a SHA-256> (44 characters after sha256/)")
			}
		}
	}
	for i, v := range c.RetiredPins {
		if !pki.ValidPin(v) {
			bad(fmt.Sprintf("retired_pins[%d]", i), "want sha256/<base64 of a SHA-256> (44 characters after sha256/)")
		}
	}
	for _, p := range []struct{ key, val string }{
		{"data_dir", c.DataDir},
		{"sysfs_root", c.SysfsRoot},
		{"procfs_root", c.ProcfsRoot},
	} {
		if p.val == "" {
			bad(p.key, "required")
		} else if !filepath.IsAbs(p.val) {
			bad(p.key, "want an absolute path")
		}
	}
	switch c.TPM.Mode {
	case TPMAuto, TPMOff, TPMRequired:
	default:
		bad("tpm.mode", "want auto, off or required")
	}
	if c.TPM.Device != "" && c.TPM.Simulator != "" {
		bad("tpm", "set device or simulator, not both")
	}
	if c.TPM.Device != "" && !filepath.IsAbs(c.TPM.Device) {
		bad("tpm.device", "want an absolute path like %s", DefaultTPMDevice)
	}
	if c.TPM.Simulator != "" && !validHostPort(c.TPM.Simulator) {
		bad("tpm.simulator", "want host:port of a swtpm command port, like 127.0.0.1:2321")
	}
	if c.TPM.Device == "" && c.TPM.Simulator == "" && c.TPM.Mode != TPMOff {
		bad("tpm.device", "required unless tpm.simulator is set or tpm.mode is off")
	}

	if len(problems) == 0 {
		return nil
	}
	return errs.New(errs.InvalidConfig, "%s", strings.Join(problems, "; "))
}

func checkGatewayURL(s string) string {
	if s == "" {
		return "required: the gateway's https URL, like https://gw.eu.example.com"
	}
	u, err := url.Parse(s)
	if err != nil {
		return "not a URL"
	}
	switch {
	case u.Scheme != "https":
		return "want an https URL (bcd only dials the gateway over TLS)"
	case u.Host == "" || u.Hostname() == "":
		return "want a host"
	case u.User != nil:
		return "must not carry credentials"
	case u.RawQuery != "" || u.Fragment != "" || u.ForceQuery:
		return "must not carry a query or fragment"
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "bad port"
		}
	}
	return ""
}

func validHostPort(s string) bool {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" {
		return false
	}
	n, err := strconv.Atoi(port)
	return err == nil && n >= 1 && n <= 65535
}

// Marshal returns c as TOML, validated first. Empty optional keys are left
// out.
func (c *Config) Marshal() ([]byte, error) {
	full := *c
	full.ApplyDefaults()
	if err := full.Validate(); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	buf.WriteString("# bcd configuration; see docs/joining.md, \"The machine's configuration\".\n")
	if err := toml.NewEncoder(&buf).Encode(c); err != nil {
		return nil, fmt.Errorf("encode config: %w", err)
	}
	return buf.Bytes(), nil
}

// Write validates c and writes it to path atomically (a temporary file in
// the same directory, fsync, rename, fsync of the directory) with mode 0644.
// The directory is created (0755) when missing, as `bcd join --server`
// does on a host without /etc/bcd (R11.3).
func (c *Config) Write(path string) error {
	data, err := c.Marshal()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("create config directory: %w", err)
	}
	return fsutil.WriteFileAtomic(path, data, 0o644)
}

// errTooLarge is readBounded's error for a file over its limit.
var errTooLarge = errors.New("the file is larger than allowed")

// readBounded reads at most limit bytes of path; more is an error.
func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%w (%d bytes)", errTooLarge, limit)
	}
	return data, nil
}
