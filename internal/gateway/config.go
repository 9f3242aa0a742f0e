package gateway

import (
	"bytes"
	"net/url"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

// Defaults for the limits in Config.
const (
	DefaultListen         = ":443"
	DefaultMaxBodyBytes   = 64 << 10
	DefaultRequestTimeout = 30 * time.Second
	DefaultAttemptTimeout = 5 * time.Second
	DefaultMaxConcurrent  = 1024
	DefaultMaxSessions    = 100000
	DefaultUpstreamConns  = 4
)

// The values of Config.DaemonHTTP2.
const (
	DaemonHTTP2NetHTTP = "net/http"
	DaemonHTTP2Framer  = "framer"
)

// The values of Config.SessionRelay.
const (
	SessionRelayGoroutines = "goroutines"
	SessionRelayCallbacks  = "callbacks"
)

// The values of Config.TLSKeyExchange.
const (
	KeyExchangeHybrid = "hybrid"
	KeyExchangeX25519 = "x25519"
)

// Config is better-compute gateway's TOML configuration.
type Config struct {
	// Listen is where daemons connect, e.g. ":443" (the default).
	Listen string `toml:"listen"`
	// CertFile and KeyFile are the gateway's certificate from
	// `better-compute pki issue-gateway`: the chain PEM (leaf first) and its
	// PKCS#8 key. The same certificate serves daemons and is the gateway's
	// client identity toward the API.
	CertFile string `toml:"cert_file"`
	KeyFile  string `toml:"key_file"`
	// APIURL is the API's agent listener, https://host:port.
	APIURL string `toml:"api_url"`
	// APIURLs lists the agent listeners of several API replicas instead
	// of APIURL: the gateway spreads calls over them, checks their health
	// and stops sending to a dead one within a second (upstreams.go).
	APIURLs []string `toml:"api_urls"`
	// APICAFile is the PEM of the serving CA that verifies the agent
	// listener's certificate.
	APICAFile string `toml:"api_ca_file"`
	// MaxBodyBytes bounds one agent message in either direction (default
	// 64 KiB).
	MaxBodyBytes int `toml:"max_body_bytes"`
	// RequestTimeout bounds one relayed call, e.g. "30s" (the default).
	RequestTimeout time.Duration `toml:"request_timeout"`
	// AttemptTimeout is how long a join or renewal waits for one API
	// replica before it is sent again, the same bytes, to another healthy
	// one, e.g. "5s" (the default); the first answer wins (hedge.go,
	// R19.2). Keep it well under request_timeout and over the API's own
	// store wait.
	AttemptTimeout time.Duration `toml:"attempt_timeout"`
	// MaxConcurrent bounds the calls in flight; beyond it a call is refused
	// at once with RESOURCE_EXHAUSTED instead of queueing (default 1024).
	MaxConcurrent int `toml:"max_concurrent"`
	// MaxSessions bounds the node sessions held at once; beyond it a new
	// session is refused with RESOURCE_EXHAUSTED (default 100000).
	MaxSessions int `toml:"max_sessions"`
	// UpstreamConns is how many connections to the API carry the relayed
	// sessions (default 4), each session on one of them in turn; with
	// several API replicas behind one address, sessions spread over them.
	UpstreamConns int `toml:"upstream_conns"`
	// TLSKeyExchange is the daemons' TLS key exchange: "hybrid" (the
	// default) prefers the post-quantum hybrid X25519MLKEM768, "x25519"
	// offers classical X25519 alone. SECURITY: x25519 gives up protection
	// of recorded traffic against a future quantum computer for about a
	// fifth less gateway CPU per full handshake
	// (docs/contributors/performance.md);
	// keep the default unless handshakes are what limits the gateway.
	TLSKeyExchange string `toml:"tls_key_exchange"`
	// DaemonHTTP2 is the HTTP/2 server that serves the daemons:
	// "framer" (the default), the gateway's own on x/net's Framer
	// (internal/gateway/h2server: one goroutine per connection, less
	// memory per held connection), or "net/http". Both serve the same
	// handler with the same limits; HTTP/1.1 goes to net/http either way.
	DaemonHTTP2 string `toml:"daemon_http2"`
	// SessionRelay is how node sessions are relayed: "callbacks" (the
	// default of a gateway of its own with daemon_http2 = "framer"),
	// h2server's stream callbacks to an h2upstream stream, no goroutine
	// and no buffer per idle session (session_callbacks.go); or
	// "goroutines" (the default otherwise, and the only relay of a
	// gateway in the API's process) through the http.Handler and
	// connect's client, two goroutines and their buffers per held session
	// (session.go).
	SessionRelay string `toml:"session_relay"`
	// Metrics serves /metrics, /livez and /readyz on their own listener
	// ([metrics] listen, e.g. "127.0.0.1:9465"; off when empty).
	Metrics MetricsConfig `toml:"metrics"`
	// Log is the gateway's log format and level ([log] format = "json").
	Log telemetry.LogConfig `toml:"log"`
	// Tracing exports OpenTelemetry traces ([tracing] otlp_endpoint); off
	// by default.
	Tracing tracing.Config `toml:"tracing"`

	// local: the gateway runs in the API's process and relays to it in
	// memory (Options.LocalAPI, inprocess.go): no api_url, no api_ca_file,
	// and the API's own log and traces.
	local bool
}

// LoadConfig reads a TOML config file; unknown keys are errors.
func LoadConfig(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, errs.New(errs.InvalidConfig, "read gateway config: %v", err)
	}
	return ParseConfig(b)
}

// ParseConfig parses TOML, rejects unknown keys, applies defaults and
// validates. Errors are INVALID_CONFIG naming the key.
func ParseConfig(b []byte) (Config, error) {
	var c Config
	md, err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c)
	if err != nil {
		return c, errs.New(errs.InvalidConfig, "gateway config: %v", err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		keys := make([]string, len(und))
		for i, k := range und {
			keys[i] = k.String()
		}
		sort.Strings(keys)
		return c, errs.New(errs.InvalidConfig, "gateway config: unknown keys: %s", strings.Join(keys, ", "))
	}
	if err := c.validate(); err != nil {
		return c, err
	}
	return c, nil
}

func badKey(key, format string, args ...any) *errs.E {
	e := errs.New(errs.InvalidConfig, "gateway config: "+key+": "+format, args...)
	e.Field = key
	return e
}

// ValidateInProcess applies defaults and checks c as the config of a
// gateway in the API's own process (better-compute serve's [gateway]
// listen): it relays to the API in memory, so api_url, api_urls and
// api_ca_file are refused, and it logs and traces with the API's [log] and
// [tracing]. New checks it again when Options.LocalAPI is set.
func (c *Config) ValidateInProcess() error {
	c.local = true
	return c.validate()
}

// validate applies defaults and checks every key; New calls it too, so a
// Config built in code gets the same checks as a file.
func (c *Config) validate() error {
	if err := c.Tracing.Validate(); err != nil {
		return err
	}
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if c.CertFile == "" {
		return badKey("cert_file", "is required (the chain from better-compute pki issue-gateway)")
	}
	if c.KeyFile == "" {
		return badKey("key_file", "is required (the PKCS#8 key from better-compute pki issue-gateway)")
	}
	if c.local {
		if err := c.checkInProcess(); err != nil {
			return err
		}
	} else if err := c.checkUpstreams(); err != nil {
		return err
	}
	switch {
	case c.MaxBodyBytes < 0:
		return badKey("max_body_bytes", "cannot be negative")
	case c.MaxBodyBytes == 0:
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	switch {
	case c.RequestTimeout < 0:
		return badKey("request_timeout", "cannot be negative")
	case c.RequestTimeout == 0:
		c.RequestTimeout = DefaultRequestTimeout
	}
	switch {
	case c.AttemptTimeout < 0:
		return badKey("attempt_timeout", "cannot be negative")
	case c.AttemptTimeout == 0:
		c.AttemptTimeout = min(DefaultAttemptTimeout, c.RequestTimeout)
	case c.AttemptTimeout > c.RequestTimeout:
		return badKey("attempt_timeout", "%s is longer than request_timeout %s: a call would never be resent", c.AttemptTimeout, c.RequestTimeout)
	}
	switch {
	case c.MaxConcurrent < 0:
		return badKey("max_concurrent", "cannot be negative")
	case c.MaxConcurrent == 0:
		c.MaxConcurrent = DefaultMaxConcurrent
	}
	switch {
	case c.MaxSessions < 0:
		return badKey("max_sessions", "cannot be negative")
	case c.MaxSessions == 0:
		c.MaxSessions = DefaultMaxSessions
	}
	switch c.TLSKeyExchange {
	case "":
		c.TLSKeyExchange = KeyExchangeHybrid
	case KeyExchangeHybrid, KeyExchangeX25519:
	default:
		return badKey("tls_key_exchange", "must be %q (the default) or %q, got %q", KeyExchangeHybrid, KeyExchangeX25519, c.TLSKeyExchange)
	}
	switch c.DaemonHTTP2 {
	case "":
		c.DaemonHTTP2 = DaemonHTTP2Framer
	case DaemonHTTP2NetHTTP, DaemonHTTP2Framer:
	default:
		return badKey("daemon_http2", "must be %q (the default) or %q, got %q", DaemonHTTP2Framer, DaemonHTTP2NetHTTP, c.DaemonHTTP2)
	}
	if err := c.checkSessionRelay(); err != nil {
		return err
	}
	switch {
	case c.UpstreamConns < 0 || c.UpstreamConns > 256:
		return badKey("upstream_conns", "must be between 1 and 256")
	case c.UpstreamConns == 0:
		c.UpstreamConns = DefaultUpstreamConns
	}
	return nil
}

// checkSessionRelay checks session_relay against daemon_http2 (already
// checked) and the API's place.
func (c *Config) checkSessionRelay() error {
	switch c.SessionRelay {
	case "":
		c.SessionRelay = SessionRelayGoroutines
		if c.DaemonHTTP2 == DaemonHTTP2Framer && !c.local {
			c.SessionRelay = SessionRelayCallbacks
		}
	case SessionRelayGoroutines:
	case SessionRelayCallbacks:
		if c.DaemonHTTP2 != DaemonHTTP2Framer {
			return badKey("session_relay", "%q needs daemon_http2 = %q (the callbacks are h2server's), got daemon_http2 = %q",
				SessionRelayCallbacks, DaemonHTTP2Framer, c.DaemonHTTP2)
		}
		if c.local {
			return badKey("session_relay", "%q is not available to a gateway in the API's process: it relays over the network to api_url", SessionRelayCallbacks)
		}
	default:
		return badKey("session_relay", "must be %q or %q, got %q", SessionRelayCallbacks, SessionRelayGoroutines, c.SessionRelay)
	}
	return nil
}

// checkUpstreams checks api_url or api_urls, and api_ca_file.
func (c *Config) checkUpstreams() error {
	switch {
	case c.APIURL == "" && len(c.APIURLs) == 0:
		return badKey("api_url", "is required (the API's agent listener, https://host:port), or api_urls for several replicas")
	case c.APIURL != "" && len(c.APIURLs) > 0:
		return badKey("api_urls", "set api_url or api_urls, not both")
	}
	key := "api_url"
	if len(c.APIURLs) > 0 {
		key = "api_urls"
	}
	seen := map[string]bool{}
	for _, a := range c.apiURLs() {
		u, err := url.Parse(a)
		if err != nil || u.Scheme != "https" || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
			return badKey(key, "must be an https://host:port URL, got %q", a)
		}
		if seen[u.Host] {
			return badKey(key, "lists %s twice", u.Host)
		}
		seen[u.Host] = true
	}
	if c.APICAFile == "" {
		return badKey("api_ca_file", "is required (the serving CA PEM that verifies the API's agent listener)")
	}
	return nil
}

// checkInProcess refuses the keys that mean nothing to a gateway in the
// API's process.
func (c *Config) checkInProcess() error {
	switch {
	case c.APIURL != "":
		return badKey("api_url", "is not used by a gateway in the API's process: it calls the API in memory")
	case len(c.APIURLs) > 0:
		return badKey("api_urls", "is not used by a gateway in the API's process: it calls the API in memory")
	case c.APICAFile != "":
		return badKey("api_ca_file", "is not used by a gateway in the API's process: it calls the API in memory")
	case c.Log != telemetry.LogConfig{}:
		return badKey("log", "a gateway in the API's process logs with the API's [log]")
	case c.Tracing.OTLPEndpoint != "" || c.Tracing.SampleRatio != nil || c.Tracing.ServiceName != "":
		return badKey("tracing", "a gateway in the API's process traces with the API's [tracing]")
	}
	return nil
}

// apiURLs returns the API replicas' agent listeners.
func (c *Config) apiURLs() []string {
	if c.local {
		return []string{LocalAPIURL}
	}
	if len(c.APIURLs) > 0 {
		return c.APIURLs
	}
	return []string{c.APIURL}
}

// Example is a commented config, for `gateway --print-config`.
const Example = `# better-compute gateway --config /etc/better-compute/gateway.toml
listen = ":443"

# from: better-compute pki issue-gateway --san gw.eu.example.com
cert_file = "/etc/better-compute/gateway.crt"   # chain PEM, leaf first
key_file = "/etc/better-compute/gateway.key"    # PKCS#8, mode 0600

# the API's agent listener and the serving CA that verifies it; with
# several API replicas list each one's instead:
#   api_urls = ["https://api-1.internal:8444", "https://api-2.internal:8444"]
api_url = "https://api.internal:8444"
api_ca_file = "/etc/better-compute/serving-ca.pem"

max_body_bytes = 65536
request_timeout = "30s"
attempt_timeout = "5s"    # a join or renewal with no answer by then is resent to another replica
max_concurrent = 1024
max_sessions = 100000
upstream_conns = 4
# the daemons' TLS key exchange: "hybrid" (X25519MLKEM768, post-quantum) or
# "x25519" (classical only: less CPU per handshake, no protection of
# recorded traffic against a future quantum computer)
tls_key_exchange = "hybrid"
# the daemons' HTTP/2 server: "framer" (the gateway's own, less memory per
# held connection) or "net/http" (Go's own)
daemon_http2 = "framer"
# how node sessions are relayed: "callbacks" (needs daemon_http2 = "framer":
# no goroutine and no buffer per idle session) or "goroutines" (two per
# session)
session_relay = "callbacks"

# /metrics, /livez and /readyz (ready: the certificate is valid and an API
# replica answers); off when empty
[metrics]
listen = "127.0.0.1:9465"

[log]
format = "text"   # or "json"
level = "info"
`
