package gateway

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

const goodTOML = `
cert_file = "/etc/bc/gw.crt"
key_file = "/etc/bc/gw.key"
api_url = "https://api.internal:8444"
api_ca_file = "/etc/bc/ca.pem"
`

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name    string
		toml    string
		wantErr string // substring; empty means valid
		check   func(t *testing.T, c Config)
	}{
		{name: "defaults", toml: goodTOML, check: func(t *testing.T, c Config) {
			if c.Listen != ":443" || c.MaxBodyBytes != 64<<10 || c.RequestTimeout != 30*time.Second || c.MaxConcurrent != 1024 {
				t.Errorf("defaults: %+v", c)
			}
		}},
		{name: "all keys", toml: goodTOML + "listen = \"127.0.0.1:8443\"\nmax_body_bytes = 1000\nrequest_timeout = \"5s\"\nmax_concurrent = 7\n", check: func(t *testing.T, c Config) {
			if c.Listen != "127.0.0.1:8443" || c.MaxBodyBytes != 1000 || c.RequestTimeout != 5*time.Second || c.MaxConcurrent != 7 {
				t.Errorf("parsed: %+v", c)
			}
		}},
		{name: "example", toml: Example},
		{name: "unknown key", toml: goodTOML + "api_urll = \"https://x\"\n", wantErr: "unknown keys: api_urll"},
		{name: "unknown table", toml: goodTOML + "[tls]\ncert_file = \"x\"\n", wantErr: "unknown keys: tls"},
		{name: "bad toml", toml: "api_url = ", wantErr: "gateway config:"},
		{name: "wrong type", toml: goodTOML + "max_concurrent = \"many\"\n", wantErr: "max_concurrent"},
		{name: "missing cert_file", toml: strings.Replace(goodTOML, "cert_file", "#", 1), wantErr: "cert_file: is required"},
		{name: "missing key_file", toml: strings.Replace(goodTOML, "key_file", "#", 1), wantErr: "key_file: is required"},
		{name: "missing api_url", toml: strings.Replace(goodTOML, "api_url =", "#", 1), wantErr: "api_url: is required"},
		{name: "missing api_ca_file", toml: strings.Replace(goodTOML, "api_ca_file", "#", 1), wantErr: "api_ca_file: is required"},
		{name: "plain http api", toml: strings.Replace(goodTOML, "https://", "http://", 1), wantErr: "api_url: must be an https://"},
		{name: "api url with query", toml: strings.Replace(goodTOML, ":8444", ":8444/?x=1", 1), wantErr: "api_url: must be"},
		{name: "negative body", toml: goodTOML + "max_body_bytes = -1\n", wantErr: "max_body_bytes: cannot be negative"},
		{name: "negative timeout", toml: goodTOML + "request_timeout = \"-1s\"\n", wantErr: "request_timeout: cannot be negative"},
		// R19.2: the per-attempt deadline of a resent join or renewal.
		{name: "attempt timeout default", toml: goodTOML, check: func(t *testing.T, c Config) {
			if c.AttemptTimeout != 5*time.Second {
				t.Errorf("attempt_timeout %s, want 5s", c.AttemptTimeout)
			}
		}},
		{name: "attempt timeout default under a short request timeout", toml: goodTOML + "request_timeout = \"2s\"\n", check: func(t *testing.T, c Config) {
			if c.AttemptTimeout != 2*time.Second {
				t.Errorf("attempt_timeout %s, want 2s", c.AttemptTimeout)
			}
		}},
		{name: "attempt timeout set", toml: goodTOML + "attempt_timeout = \"1500ms\"\n", check: func(t *testing.T, c Config) {
			if c.AttemptTimeout != 1500*time.Millisecond {
				t.Errorf("attempt_timeout %s, want 1.5s", c.AttemptTimeout)
			}
		}},
		{name: "negative attempt timeout", toml: goodTOML + "attempt_timeout = \"-1s\"\n", wantErr: "attempt_timeout: cannot be negative"},
		{name: "attempt timeout over the request timeout", toml: goodTOML + "attempt_timeout = \"40s\"\n", wantErr: "attempt_timeout: 40s is longer than request_timeout 30s"},
		{name: "key exchange default", toml: goodTOML, check: func(t *testing.T, c Config) {
			if c.TLSKeyExchange != KeyExchangeHybrid {
				t.Errorf("tls_key_exchange %q, want hybrid", c.TLSKeyExchange)
			}
		}},
		{name: "key exchange x25519", toml: goodTOML + "tls_key_exchange = \"x25519\"\n", check: func(t *testing.T, c Config) {
			if c.TLSKeyExchange != KeyExchangeX25519 {
				t.Errorf("tls_key_exchange %q, want x25519", c.TLSKeyExchange)
			}
		}},
		{name: "key exchange unknown", toml: goodTOML + "tls_key_exchange = \"p256\"\n", wantErr: "tls_key_exchange: must be"},
		{name: "daemon HTTP/2 default", toml: goodTOML, check: func(t *testing.T, c Config) {
			if c.DaemonHTTP2 != DaemonHTTP2Framer {
				t.Errorf("daemon_http2 %q, want framer", c.DaemonHTTP2)
			}
		}},
		{name: "daemon HTTP/2 net/http", toml: goodTOML + "daemon_http2 = \"net/http\"\n", check: func(t *testing.T, c Config) {
			if c.DaemonHTTP2 != DaemonHTTP2NetHTTP || c.SessionRelay != SessionRelayGoroutines {
				t.Errorf("daemon_http2 %q, session_relay %q; want net/http, goroutines", c.DaemonHTTP2, c.SessionRelay)
			}
		}},
		{name: "daemon HTTP/2 unknown", toml: goodTOML + "daemon_http2 = \"h2c\"\n", wantErr: "daemon_http2: must be"},
		{name: "session relay default", toml: goodTOML, check: func(t *testing.T, c Config) {
			if c.SessionRelay != SessionRelayCallbacks {
				t.Errorf("session_relay %q, want callbacks", c.SessionRelay)
			}
		}},
		{name: "session relay on goroutines", toml: goodTOML + "session_relay = \"goroutines\"\n", check: func(t *testing.T, c Config) {
			if c.DaemonHTTP2 != DaemonHTTP2Framer || c.SessionRelay != SessionRelayGoroutines {
				t.Errorf("daemon_http2 %q, session_relay %q; want framer, goroutines", c.DaemonHTTP2, c.SessionRelay)
			}
		}},
		{name: "session relay on callbacks", toml: goodTOML + "daemon_http2 = \"framer\"\nsession_relay = \"callbacks\"\n", check: func(t *testing.T, c Config) {
			if c.SessionRelay != SessionRelayCallbacks {
				t.Errorf("session_relay %q, want callbacks", c.SessionRelay)
			}
		}},
		{name: "session relay on callbacks without the framer", toml: goodTOML + "daemon_http2 = \"net/http\"\nsession_relay = \"callbacks\"\n",
			wantErr: `session_relay: "callbacks" needs daemon_http2 = "framer"`},
		{name: "session relay unknown", toml: goodTOML + "session_relay = \"threads\"\n", wantErr: "session_relay: must be"},
		{name: "negative concurrency", toml: goodTOML + "max_concurrent = -1\n", wantErr: "max_concurrent: cannot be negative"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(tc.toml))
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("ParseConfig: %v", err)
				}
				if tc.check != nil {
					tc.check(t, c)
				}
				return
			}
			if err == nil {
				t.Fatalf("ParseConfig accepted it: %+v", c)
			}
			if !errs.Is(err, errs.InvalidConfig) || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("got %v, want INVALID_CONFIG with %q", err, tc.wantErr)
			}
		})
	}
}

func TestLoadConfigFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "gateway.toml")
	if err := os.WriteFile(p, []byte(goodTOML), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(p); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(p + ".missing"); !errs.Is(err, errs.InvalidConfig) {
		t.Fatalf("missing file: %v", err)
	}
}

func TestNewChecksFiles(t *testing.T) {
	e := newEnv(t)
	notPEM := e.write(t, "not.pem", []byte("hello"))
	caOnly := e.caFile
	serverOnlyCert, serverOnlyKey := e.issue(t, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth})

	tests := []struct {
		name    string
		mutate  func(c *Config)
		wantKey string
	}{
		{"missing cert", func(c *Config) { c.CertFile = filepath.Join(e.dir, "nope.crt") }, "cert_file"},
		{"key does not match", func(c *Config) { c.KeyFile = notPEM }, "cert_file"},
		{"CA file missing", func(c *Config) { c.APICAFile = filepath.Join(e.dir, "nope.pem") }, "api_ca_file"},
		{"CA file without certificates", func(c *Config) { c.APICAFile = notPEM }, "api_ca_file"},
		{"CA file as the certificate", func(c *Config) { c.CertFile = caOnly }, "cert_file"},
		{"serverAuth only", func(c *Config) { c.CertFile, c.KeyFile = serverOnlyCert, serverOnlyKey }, "cert_file"},
		{"invalid config", func(c *Config) { c.APIURL = "ftp://x" }, "api_url"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.config("https://127.0.0.1:1")
			tc.mutate(&cfg)
			_, err := New(cfg, Options{Log: quietLog()})
			pe, ok := errs.As(err)
			if !ok || pe.Code != errs.InvalidConfig || pe.Field != tc.wantKey {
				t.Fatalf("got %v, want INVALID_CONFIG on %s", err, tc.wantKey)
			}
		})
	}
	t.Run("expired certificate", func(t *testing.T) {
		_, err := New(e.config("https://127.0.0.1:1"), Options{Log: quietLog(), Clock: clock.NewFake(testNow.Add(48 * time.Hour))})
		if pe, ok := errs.As(err); !ok || pe.Field != "cert_file" || !strings.Contains(pe.Message, "valid from") {
			t.Fatalf("got %v, want INVALID_CONFIG on cert_file", err)
		}
	})
}
