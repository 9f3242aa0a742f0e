package server

import (
	"slices"
	"strings"
	"testing"
	"time"
)

// parseCase parses a case's TOML: with wantErr, it checks the error names
// it and reports false; without, it fails the test on any error.
func parseCase(t *testing.T, toml, wantErr string) (Config, bool) {
	t.Helper()
	cfg, err := ParseConfig([]byte(toml))
	if wantErr != "" {
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Fatalf("got %v, want an error containing %q", err, wantErr)
		}
		return cfg, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return cfg, true
}

// R10.5: [join] attestors names JoinService's attestors: join-token by
// default, x509pop on request, and anything else is a config error.
func TestJoinAttestorsConfigR10_5(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml string
		want       []string
		err        string
	}{
		{name: "default", toml: base, want: []string{"join-token"}},
		{name: "x509pop", toml: base + "[join]\nattestors = [\"join-token\", \"x509pop\"]\n", want: []string{"join-token", "x509pop"}},
		{name: "x509pop only", toml: base + "[join]\nattestors = [\"x509pop\"]\n", want: []string{"x509pop"}},
		{name: "unknown", toml: base + "[join]\nattestors = [\"join-token\", \"sgx\"]\n", err: `unknown attestor "sgx"`},
		{name: "R9.2 tpm without pools", toml: base + "[join]\nattestors = [\"join-token\", \"tpm\"]\n", err: "no [[join.tpm.pools]]"},
		{name: "R9.2 tpm pool id", toml: base + "[join]\nattestors = [\"tpm\"]\n[[join.tpm.pools]]\npool = \"nope\"\n", err: "want a pool id"},
		{name: "twice", toml: base + "[join]\nattestors = [\"x509pop\", \"x509pop\"]\n", err: "listed twice"},
		{name: "empty", toml: base + "[join]\nattestors = []\n", err: "join.attestors is empty"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if !slices.Equal(cfg.Join.Attestors, c.want) {
				t.Errorf("attestors %v, want %v", cfg.Join.Attestors, c.want)
			}
		})
	}
	if _, err := ParseConfig([]byte(Example)); err != nil {
		t.Errorf("the example config: %v", err)
	}
}

// R20.1: [join] svid_form is "page" by default, "spiffe-strict" on request,
// and anything else is a config error.
func TestJoinSVIDFormConfigR20_1(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml, want, err string
	}{
		{name: "default", toml: base, want: "page"},
		{name: "page", toml: base + "[join]\nsvid_form = \"page\"\n", want: "page"},
		{name: "strict", toml: base + "[join]\nsvid_form = \"spiffe-strict\"\n", want: "spiffe-strict"},
		{name: "unknown", toml: base + "[join]\nsvid_form = \"strict\"\n", err: `join.svid_form must be "page" or "spiffe-strict"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if cfg.Join.SVIDForm != c.want {
				t.Errorf("svid_form %q, want %q", cfg.Join.SVIDForm, c.want)
			}
		})
	}
}

// R10.4: [join] vouch_wait is how long a discovery join waits for its
// vouch: join.DefaultVouchWait unset, a duration above 0 up to 30s, and
// anything else a config error.
func TestJoinVouchWaitConfigR10_4(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml string
		want       time.Duration
		err        string
	}{
		{name: "unset", toml: base, want: 0},
		{name: "3s", toml: base + "[join]\nvouch_wait = \"3s\"\n", want: 3 * time.Second},
		{name: "30s", toml: base + "[join]\nvouch_wait = \"30s\"\n", want: 30 * time.Second},
		{name: "too long", toml: base + "[join]\nvouch_wait = \"31s\"\n", err: "join.vouch_wait must be more than 0 and at most 30s"},
		{name: "negative", toml: base + "[join]\nvouch_wait = \"-1s\"\n", err: "join.vouch_wait must be more than 0"},
		{name: "not a duration", toml: base + "[join]\nvouch_wait = \"soon\"\n", err: "vouch_wait"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if cfg.Join.VouchWait != c.want {
				t.Errorf("vouch_wait %s, want %s", cfg.Join.VouchWait, c.want)
			}
		})
	}
}

// R12.1: [session] heartbeat_mac checks heartbeats by MAC unless set to
// false.
func TestSessionHeartbeatMACConfigR12_1(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml string
		want       bool
	}{
		{name: "default", toml: base, want: true},
		{name: "on", toml: base + "[session]\nheartbeat_mac = true\n", want: true},
		{name: "off", toml: base + "[session]\nheartbeat_mac = false\n", want: false},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, _ := parseCase(t, c.toml, "")
			if got := cfg.Session.MAC(); got != c.want {
				t.Errorf("MAC() = %v, want %v", got, c.want)
			}
		})
	}
}

// [agent] http2 chooses the agent listener's HTTP/2 server: net/http by
// default, h2server ("framer") on request, anything else is a config
// error.
func TestAgentHTTP2Config(t *testing.T) {
	base := "[store]\npath = \"/tmp/bc.db\"\n"
	for _, c := range []struct {
		name, toml string
		framer     bool
		err        string
	}{
		{name: "default", toml: base, framer: true},
		{name: "net/http", toml: base + "[agent]\nhttp2 = \"net/http\"\n"},
		{name: "framer", toml: base + "[agent]\nhttp2 = \"framer\"\n", framer: true},
		{name: "unknown", toml: base + "[agent]\nhttp2 = \"h2c\"\n", err: "agent.http2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, ok := parseCase(t, c.toml, c.err)
			if !ok {
				return
			}
			if cfg.Agent.Framer() != c.framer || c.name == "default" && cfg.Agent.HTTP2 != AgentHTTP2Framer {
				t.Errorf("http2 %q, framer %v; want framer %v", cfg.Agent.HTTP2, cfg.Agent.Framer(), c.framer)
			}
		})
	}
}
