// Package server runs the control plane's processes from a config file:
// `better-compute serve` (the API) with its listeners, TLS, metrics,
// timeouts and graceful shutdown.
package server

import (
	"bytes"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/export"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tpmverify"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Config is better-compute serve's TOML configuration.
type Config struct {
	// Listen is the API's address, e.g. ":8443".
	Listen string `toml:"listen"`
	// BasePath prefixes the API (default /api/compute).
	BasePath string `toml:"base_path"`
	// RootTenant is the name of the deployment's root tenant, created on
	// first start.
	RootTenant string        `toml:"root_tenant"`
	TLS        TLSConfig     `toml:"tls"`
	Store      store.Config  `toml:"store"`
	PKI        PKIConfig     `toml:"pki"`
	Gateway    GatewayConfig `toml:"gateway"`
	Agent      AgentConfig   `toml:"agent"`
	Join       JoinConfig    `toml:"join"`
	Session    SessionConfig `toml:"session"`
	Metrics    MetricsConfig `toml:"metrics"`
	// Log is the log format and level ([log] format = "json").
	Log telemetry.LogConfig `toml:"log"`
	// Tracing exports OpenTelemetry traces ([tracing] otlp_endpoint); off
	// by default.
	Tracing tracing.Config `toml:"tracing"`
	Limits  LimitsConfig   `toml:"limits"`
	// Export ships events and audit rows to external sinks (R17.4).
	Export export.Config `toml:"export"`
	// Downloads serves the bcd builds install scripts fetch (R11.5).
	Downloads DownloadsConfig `toml:"downloads"`
}

// DownloadsConfig is the directory of bcd builds, laid out as
// bcd/{version}/linux-{amd64,arm64}; empty serves none.
type DownloadsConfig struct {
	Dir string `toml:"dir"`
}

// TLSConfig serves the API over TLS; leave it empty behind a TLS proxy.
type TLSConfig struct {
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
}

// PKIConfig points at the bundle written by `better-compute pki init`. Its
// private keys are decrypted with BETTER_COMPUTE_SECRET. Without a bundle the
// API runs, but every join answers INVALID_CONFIG.
type PKIConfig struct {
	Dir string `toml:"dir"`
}

// GatewayConfig is what the well-known document publishes about the
// gateway (url, server_name) and, with listen set, a gateway run in this
// process: the keys of better-compute gateway's config (listen, cert_file,
// key_file, the limits, [gateway.metrics]) without api_url and api_ca_file,
// because it calls the API's agent handler in memory instead of the agent
// listener (internal/gateway/inprocess.go). The split deployment (serve and
// better-compute gateway) is the one for regions.
type GatewayConfig struct {
	URL        string `toml:"url"`
	ServerName string `toml:"server_name"`
	gateway.Config
}

// InProcess reports whether serve runs the gateway itself.
func (g GatewayConfig) InProcess() bool { return g.Listen != "" }

// AgentConfig is the listener gateways relay the agent protocol to. It
// requires TLS client certificates from the serving CA (gateway identities)
// and serves its own certificate, e.g. one from `pki issue-gateway --san
// api.internal`.
type AgentConfig struct {
	Listen   string `toml:"listen"`
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// HTTP2 is the HTTP/2 server of the listener: "framer" (the
	// default), h2server (internal/gateway/h2server), which holds each
	// node session on callbacks, without a goroutine while it is idle,
	// and serves every other call as net/http does; or "net/http", Go's
	// own (two goroutines and their buffers per held session).
	HTTP2 string `toml:"http2"`
}

// The values of AgentConfig.HTTP2.
const (
	AgentHTTP2NetHTTP = "net/http"
	AgentHTTP2Framer  = "framer"
)

// Framer reports whether the agent listener runs on h2server: unless
// net/http is asked for (a Config built in code gets the default too).
func (a AgentConfig) Framer() bool { return a.HTTP2 != AgentHTTP2NetHTTP }

// SessionConfig tunes the node sessions the API holds.
type SessionConfig struct {
	// HeartbeatMAC checks each heartbeat of a session by an HMAC under a
	// key the daemon and the API agree at the session's start (X25519,
	// the daemon's key bound by its node-key proof) instead of an ECDSA
	// signature: about a thousandth of the CPU per heartbeat. Daemons
	// that offer no key keep signing theirs. Default on; false makes
	// every daemon sign its heartbeats again.
	HeartbeatMAC *bool `toml:"heartbeat_mac"`
}

// MAC reports whether heartbeats are checked by MAC ([session]
// heartbeat_mac, on unless set to false).
func (s SessionConfig) MAC() bool { return s.HeartbeatMAC == nil || *s.HeartbeatMAC }

// JoinConfig tunes JoinService.
type JoinConfig struct {
	// CertTTLSeconds is the node certificate lifetime (default and maximum
	// 86400).
	CertTTLSeconds int `toml:"cert_ttl_seconds"`
	// SVIDForm is where node certificates carry the TPM statement
	// (R20.1): "page" (the default, the statement in a second URI SAN)
	// or "spiffe-strict" (one URI SAN, the statement in a
	// non-critical extension, for relying parties that enforce the SPIFFE
	// X.509-SVID spec). Nodes move to it at their next renewal.
	SVIDForm string `toml:"svid_form"`
	// Attestors are the attestors JoinService runs (default
	// ["join-token"]; "x509pop" re-joins nodes whose certificate expired
	// while offline, R10.5). Unknown names are config errors.
	Attestors []string `toml:"attestors"`
	// TPM is the tpm attestor's EK trust (R9.2), [[join.tpm.pools]].
	TPM TPMJoinConfig `toml:"tpm"`
	// MaxPendingRequestsPerPool bounds the pending join requests (unknown
	// EKs enrolling, network-booted machines waiting) of one pool (R15.4;
	// default 1000). Past it a new machine's join is refused
	// (join-requests-pool-limit) until someone decides the waiting ones.
	MaxPendingRequestsPerPool int `toml:"max_pending_requests_per_pool"`
	// MaxPendingRequestsPerSource bounds those from one peer address,
	// across pools (default 20; join-requests-source-limit).
	MaxPendingRequestsPerSource int `toml:"max_pending_requests_per_source"`
	// VouchWait is how long a discovery join waits for its site agent's
	// vouch before it becomes a join request or is refused (R10.4), as a
	// duration ("8s"); more than 0 and at most 30s, below the gateway's
	// request timeout (0: join.DefaultVouchWait).
	VouchWait time.Duration `toml:"vouch_wait"`
}

// maxVouchWait bounds join.vouch_wait: a waiting discovery join holds a
// gateway request open, and the gateway gives up on one after 30 s.
const maxVouchWait = 30 * time.Second

// TPMJoinConfig is the tpm attestor's EK trust, per pool (R9.2).
type TPMJoinConfig struct {
	// Pools are tried in order: an EK joins the first pool that trusts
	// it; an unknown EK becomes a join request in the first pool with
	// enrollment on, and is otherwise refused.
	Pools []TPMPoolConfig `toml:"pools"`
}

// TPMPoolConfig is one pool's EK trust.
type TPMPoolConfig struct {
	// Pool is the pool id (pool_…).
	Pool string `toml:"pool"`
	// ManufacturerCAFiles are PEM files of TPM manufacturer CAs: an EK
	// whose certificate chains to one is trusted.
	ManufacturerCAFiles []string `toml:"manufacturer_ca_files"`
	// EKSHA256 lists trusted EKs by hex SHA-256 of their public key's
	// SubjectPublicKeyInfo.
	EKSHA256 []string `toml:"ek_sha256"`
	// Enrollment turns an unknown EK into a join request in this pool.
	Enrollment bool `toml:"enrollment"`
	// AllowReclaim lets a machine whose TPM (the same EK and AK) belongs
	// to a node of this pool take that node back after its disk was wiped
	// or bcd was reset, instead of joining as another node.
	AllowReclaim bool `toml:"allow_reclaim"`
}

// MetricsConfig serves Prometheus metrics on their own listener.
type MetricsConfig struct {
	// Listen is the metrics listener's address; empty (the default): no
	// listener, and the API counts nothing.
	Listen string `toml:"listen"`
	// Pprof also serves Go's profiler under /debug/pprof/ on the metrics
	// listener (keep that listener on loopback).
	Pprof bool `toml:"pprof"`
}

// LimitsConfig bounds requests.
type LimitsConfig struct {
	MaxBodyBytes        int `toml:"max_body_bytes"`
	ReadTimeoutSeconds  int `toml:"read_timeout_seconds"`
	WriteTimeoutSeconds int `toml:"write_timeout_seconds"`
}

func (l LimitsConfig) read() time.Duration {
	if l.ReadTimeoutSeconds > 0 {
		return time.Duration(l.ReadTimeoutSeconds) * time.Second
	}
	return 30 * time.Second
}

func (l LimitsConfig) write() time.Duration {
	if l.WriteTimeoutSeconds > 0 {
		return time.Duration(l.WriteTimeoutSeconds) * time.Second
	}
	return 60 * time.Second
}

// LoadConfig reads a TOML config; unknown keys are errors.
func LoadConfig(path string) (Config, error) {
	var c Config
	b, err := os.ReadFile(path)
	if err != nil {
		return c, errs.New(errs.InvalidConfig, "read config: %v", err)
	}
	return ParseConfig(b)
}

// ParseConfig parses TOML; unknown keys are errors.
func ParseConfig(b []byte) (Config, error) {
	var c Config
	md, err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c)
	if err != nil {
		return c, errs.New(errs.InvalidConfig, "config: %v", err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		keys := make([]string, len(und))
		for i, k := range und {
			keys[i] = k.String()
		}
		return c, errs.New(errs.InvalidConfig, "config: unknown keys: %s", strings.Join(keys, ", "))
	}
	return c, c.validate()
}

// Overlay decodes the TOML b over c: the keys b sets replace c's, the
// rest stay (better-compute dev --config). Unknown keys are errors, the
// result is validated as a whole, and the keys b set are returned
// (dotted, as "join.svid_form").
func Overlay(c Config, b []byte) (Config, []string, error) {
	md, err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c)
	if err != nil {
		return c, nil, errs.New(errs.InvalidConfig, "config: %v", err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		keys := make([]string, len(und))
		for i, k := range und {
			keys[i] = k.String()
		}
		return c, nil, errs.New(errs.InvalidConfig, "config: unknown keys: %s", strings.Join(keys, ", "))
	}
	var set []string
	for _, k := range md.Keys() {
		set = append(set, k.String())
	}
	return c, set, c.validate()
}

func (c *Config) validate() error {
	if err := c.Tracing.Validate(); err != nil {
		return err
	}
	if c.Listen == "" {
		c.Listen = "127.0.0.1:8080"
	}
	if c.RootTenant == "" {
		c.RootTenant = "root"
	}
	if (c.TLS.CertFile == "") != (c.TLS.KeyFile == "") {
		return errs.New(errs.InvalidConfig, "config: tls.cert_file and tls.key_file go together")
	}
	if c.Limits.MaxBodyBytes < 0 || c.Limits.ReadTimeoutSeconds < 0 || c.Limits.WriteTimeoutSeconds < 0 {
		return errs.New(errs.InvalidConfig, "config: limits cannot be negative")
	}
	if c.Agent.Listen != "" && (c.Agent.CertFile == "" || c.Agent.KeyFile == "" || c.PKI.Dir == "") {
		return errs.New(errs.InvalidConfig, "config: agent.listen needs agent.cert_file, agent.key_file and pki.dir")
	}
	switch c.Agent.HTTP2 {
	case "":
		c.Agent.HTTP2 = AgentHTTP2Framer
	case AgentHTTP2NetHTTP, AgentHTTP2Framer:
	default:
		return errs.New(errs.InvalidConfig, "config: agent.http2 must be %q (the default) or %q, got %q", AgentHTTP2Framer, AgentHTTP2NetHTTP, c.Agent.HTTP2)
	}
	if c.Join.MaxPendingRequestsPerPool < 0 || c.Join.MaxPendingRequestsPerSource < 0 {
		return errs.New(errs.InvalidConfig, "config: join.max_pending_requests_per_pool and _per_source: want a positive count (0: the default)")
	}
	if c.Join.VouchWait < 0 || c.Join.VouchWait > maxVouchWait {
		return errs.New(errs.InvalidConfig, "config: join.vouch_wait must be more than 0 and at most %s (as \"8s\"; unset: %s)", maxVouchWait, join.DefaultVouchWait)
	}
	if c.Join.CertTTLSeconds != 0 && (c.Join.CertTTLSeconds < 60 || c.Join.CertTTLSeconds > 86400) {
		return errs.New(errs.InvalidConfig, "config: join.cert_ttl_seconds must be from 60 to 86400")
	}
	if err := export.Check(c.Export); err != nil {
		return errs.New(errs.InvalidConfig, "config: %v", err)
	}
	if c.Join.SVIDForm == "" {
		c.Join.SVIDForm = pki.SVIDFormPage
	}
	if !pki.ValidSVIDForm(c.Join.SVIDForm) {
		return errs.New(errs.InvalidConfig, "config: join.svid_form must be %q or %q", pki.SVIDFormPage, pki.SVIDFormStrict)
	}
	if c.Join.Attestors == nil {
		c.Join.Attestors = append([]string(nil), api.DefaultAttestors...)
	}
	if len(c.Join.Attestors) == 0 {
		return errs.New(errs.InvalidConfig, "config: join.attestors is empty: name at least one attestor (join-token)")
	}
	if err := api.ValidateAttestors(c.Join.Attestors); err != nil {
		return err
	}
	if _, err := c.Join.TPM.AttestorPools(); err != nil {
		return err
	}
	if slices.Contains(c.Join.Attestors, wire.AttestorTPM) && len(c.Join.TPM.Pools) == 0 {
		return errs.New(errs.InvalidConfig, "config: join.attestors names tpm, but no [[join.tpm.pools]] says which EKs join which pool")
	}
	if c.Downloads.Dir != "" && !filepath.IsAbs(c.Downloads.Dir) {
		return errs.New(errs.InvalidConfig, "config: downloads.dir must be an absolute path")
	}
	if c.Gateway.URL != "" && !strings.HasPrefix(c.Gateway.URL, "https://") {
		return errs.New(errs.InvalidConfig, "config: gateway.url must be an https:// URL")
	}
	if err := c.validateGateway(); err != nil {
		return err
	}
	if c.Store.Driver == "" || c.Store.Driver == "sqlite" {
		if c.Store.Path == "" {
			return errs.New(errs.InvalidConfig, "config: store.path (the SQLite file) is required, or set store.driver = \"postgres\" and store.dsn")
		}
	}
	return nil
}

// validateGateway checks the in-process gateway's keys with the gateway's
// own rules; without gateway.listen, none of them may be set.
func (c *Config) validateGateway() error {
	if !c.Gateway.InProcess() {
		if !reflect.ValueOf(c.Gateway.Config).IsZero() {
			return errs.New(errs.InvalidConfig, "config: gateway.listen is required to run the gateway in this process (the other [gateway] keys beside url and server_name configure it)")
		}
		return nil
	}
	if c.PKI.Dir == "" {
		return errs.New(errs.InvalidConfig, "config: gateway.listen needs pki.dir (the gateway relays to JoinService)")
	}
	if err := c.Gateway.ValidateInProcess(); err != nil {
		var e *errs.E
		if errors.As(err, &e) {
			// Keys as this file names them.
			e.Message = strings.Replace(e.Message, "gateway config: ", "config: gateway.", 1)
			if e.Field != "" {
				e.Field = "gateway." + e.Field
			}
		}
		return err
	}
	return nil
}

// Example is a commented config, printed by `serve --print-config`.
const Example = `# better-compute serve --config /etc/better-compute/config.toml
listen = ":8443"
base_path = "/api/compute"
root_tenant = "root"

[tls]                      # omit behind a TLS-terminating proxy; serve refuses to start without these files
cert_file = "/etc/better-compute/tls.crt"   # your CA's, or: better-compute pki issue-gateway --san compute.example.com
key_file = "/etc/better-compute/tls.key"

[store]
driver = "sqlite"          # or "postgres"
path = "/var/lib/better-compute/bc.db"
# dsn = "postgres://bc@db.internal:5432/bc?sslmode=verify-full"

[pki]                      # from: better-compute pki init (keys need BETTER_COMPUTE_SECRET)
dir = "/var/lib/better-compute/pki"

[gateway]                  # published in the well-known document
url = "https://gw.eu.example.com"
server_name = "gw.eu.example.com"
# One process when one machine is enough: serve runs the gateway too and
# calls the API in memory (no [agent] listener needed; regions run
# better-compute gateway instead). The gateway's keys, without api_url:
# listen = ":443"
# cert_file = "/etc/better-compute/gateway.crt"   # better-compute pki issue-gateway --san gw.eu.example.com
# key_file = "/etc/better-compute/gateway.key"
# max_sessions = 100000
# daemon_http2 = "framer"     # or "net/http": Go's own HTTP/2 server
# [gateway.metrics]
# listen = "127.0.0.1:9465"  # the gateway's /metrics, /livez, /readyz

[agent]                    # where gateways relay joins (mTLS, serving-CA client certs)
listen = ":8444"
cert_file = "/etc/better-compute/agent.crt"   # better-compute pki issue-gateway --san api.internal
key_file = "/etc/better-compute/agent.key"
# http2 = "framer"         # or "net/http": a goroutine pair per held session (docs/operations/configure.md)

[join]
cert_ttl_seconds = 86400
attestors = ["join-token"] # add "x509pop" to re-join nodes whose certificate expired while offline
svid_form = "page"         # "spiffe-strict": one URI SAN, the TPM statement in an extension (go-spiffe, Envoy)

[session]
heartbeat_mac = true       # heartbeats checked by an HMAC under a per-session key (X25519); false: an ECDSA signature per heartbeat

[downloads]                # bcd builds for install scripts: bcd/{version}/linux-{amd64,arm64}
dir = "/var/lib/better-compute/downloads"

# [[export.sinks]]         # events and audit rows to a SIEM, at least once, deduped by id (docs/operations/events.md)
# kind = "webhook"
# url = "https://siem.example.com/ingest"
# ca_file = "/etc/better-compute/siem-ca.pem"
# secret_file = "/etc/better-compute/siem.token"   # sent as a bearer token; auth = "hmac" signs the body instead
# kinds = ["events", "audit"]
# [[export.sinks]]
# kind = "file"
# path = "/var/log/better-compute/audit.jsonl"

[metrics]
listen = "127.0.0.1:9090"

[log]
format = "text"            # or "json": one object a line, the same keys on every process
level = "info"

[limits]
max_body_bytes = 1048576
read_timeout_seconds = 30
write_timeout_seconds = 60
`

// AttestorPools reads the pools' EK trust (the manufacturer CA files) for
// the tpm attestor.
func (t TPMJoinConfig) AttestorPools() ([]tpm.Pool, error) {
	out := make([]tpm.Pool, 0, len(t.Pools))
	for i, p := range t.Pools {
		if !ids.Valid(ids.Pool, p.Pool) {
			return nil, errs.New(errs.InvalidConfig, "config: join.tpm.pools[%d].pool: want a pool id like pool_01k…", i)
		}
		ap := tpm.Pool{PoolID: p.Pool, Enrollment: p.Enrollment, AllowReclaim: p.AllowReclaim}
		if len(p.ManufacturerCAFiles) > 0 {
			cas, err := tpmverify.LoadCAs(p.ManufacturerCAFiles)
			if err != nil {
				return nil, errs.New(errs.InvalidConfig, "config: join.tpm.pools[%d]: %v", i, err)
			}
			ap.Trust.CAs = cas
		}
		for _, h := range p.EKSHA256 {
			b, err := hex.DecodeString(strings.TrimPrefix(strings.ToLower(h), "sha256:"))
			if err != nil || len(b) != 32 {
				return nil, errs.New(errs.InvalidConfig, "config: join.tpm.pools[%d].ek_sha256: %q is not a hex SHA-256", i, h)
			}
			ap.Trust.EKHashes = append(ap.Trust.EKHashes, b)
		}
		out = append(out, ap)
	}
	return out, nil
}
