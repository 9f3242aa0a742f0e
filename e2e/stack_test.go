package e2e

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// gatewayMode is where a stack's gateway runs.
type gatewayMode int

const (
	// gatewayProcess is better-compute gateway in its own process, relaying
	// to serve's agent listener (the production shape).
	gatewayProcess gatewayMode = iota
	// gatewayInServe is serve's [gateway] listen: the gateway in serve's
	// process, relaying in memory.
	gatewayInServe
	// noGateway runs serve alone.
	noGateway
)

// stackOpts says what a stack runs. The zero value is serve on SQLite in
// the test's directory and a gateway in its own process.
type stackOpts struct {
	// Store is the body of serve's [store] table; empty is SQLite.
	Store string
	// Gateway is where the gateway runs.
	Gateway gatewayMode
	// Advertise names the gateway in serve's [gateway] url, which the
	// well-known document publishes (bcd join --server reads it there).
	// serve must name the gateway before the gateway can start (the gateway
	// needs serve's agent address), so with Advertise the gateway's port is
	// the one picked ahead of time; every other listener binds port 0 and
	// its address is read from the process's ready line.
	Advertise bool
	// Metrics serves serve's [metrics]; GatewayMetrics the gateway's.
	Metrics, GatewayMetrics bool
	// CertTTLSeconds is [join] cert_ttl_seconds; 0 keeps the default.
	CertTTLSeconds int
	// ServeTOML is appended to serve.toml: whole tables other than those
	// the stack writes ([store], [pki], [agent], [gateway], [metrics],
	// [join]).
	ServeTOML string
	// GatewayTOML is more top-level keys of gateway.toml, e.g.
	// request_timeout = "5s".
	GatewayTOML string
	// GatewayCAFile is the gateway's api_ca_file; empty is the serving CA
	// pki init wrote.
	GatewayCAFile string
	// beforeGateway, when set, runs once serve is up, before the gateway
	// process starts (to write what its config names).
	beforeGateway func(*stack)
}

// stack is a control plane the test started: serve and its gateway as
// real processes, bootstrapped, with the addresses they bound.
type stack struct {
	t         *testing.T
	o         stackOpts
	bc, bcd   string
	dir       string
	secretEnv []string
	// pins are `pki pins --json`.
	pins                   map[string]any
	serveConf, gatewayConf string
	serve, gateway         *proc
	// api, agent, gw, metrics and gwMetrics are the bound host:port of
	// each listener ("" when not run).
	api, agent, gw, metrics, gwMetrics string
	// apiURL is http://<api>, what the CLI and bcd join --server take.
	apiURL         string
	tenant, apiKey string
	// env is BETTER_COMPUTE_URL and BETTER_COMPUTE_API_KEY for the CLI.
	env []string
}

// The ready lines serve and the gateway log, with the address each listener
// bound. Attributes of the logger (process=gateway in serve) may come
// between the message and the address.
var (
	agentAddrRE      = readyLine(`agent listener \(gateways, mTLS\)`, "addr")
	apiURLRE         = readyLine(`API listening`, "url")
	gatewayRE        = readyLine(`gateway listening`, "addr")
	metricsRE        = readyLine(`metrics listening`, "addr")
	gatewayMetricsRE = readyLine(`gateway metrics listening`, "addr")
)

// readyLine matches the log line msg="<msg>" and captures its key's value.
func readyLine(msg, key string) *regexp.Regexp {
	return regexp.MustCompile(`msg="` + msg + `"(?: \S+=\S+)*? ` + key + `=(\S+)`)
}

// startStack makes a PKI (pki init, the gateway's and the agent's
// certificates), writes serve.toml, bootstraps, and starts serve and the
// gateway, each waited for until it logged its listeners. The config files
// are then rewritten with the bound addresses, so restartServe and
// restartGateway bring a process back where its peers know it.
func startStack(t *testing.T, o stackOpts) *stack {
	t.Helper()
	bc, bcd := binaries(t)
	dir := t.TempDir()
	s := &stack{t: t, o: o, bc: bc, bcd: bcd, dir: dir,
		serveConf: filepath.Join(dir, "serve.toml"), gatewayConf: filepath.Join(dir, "gateway.toml"),
		api: "127.0.0.1:0", agent: "127.0.0.1:0", gw: "127.0.0.1:0", metrics: "127.0.0.1:0", gwMetrics: "127.0.0.1:0"}
	s.secretEnv, s.pins = initPKI(t, bc, dir)
	if o.Advertise {
		// serve.toml names the gateway before the gateway can start.
		s.gw = freePort(t)
	}
	s.writeServe()
	boot, errOut, code := run(t, nil, "", bc, "bootstrap", "--config", s.serveConf, "--json")
	if code != 0 {
		t.Fatal(errOut)
	}
	b := jsonOf(t, boot)
	s.tenant, s.apiKey = b["tenantId"].(string), b["apiKey"].(string)
	s.startServe()
	s.apiURL = "http://" + s.api
	if o.Gateway == gatewayProcess {
		if o.beforeGateway != nil {
			o.beforeGateway(s)
		}
		s.startGateway()
	}
	s.env = []string{"BETTER_COMPUTE_URL=" + s.apiURL, "BETTER_COMPUTE_API_KEY=" + s.apiKey}
	return s
}

// startServe starts serve, reads its listeners' addresses and keeps them in
// serve.toml.
func (s *stack) startServe() {
	s.t.Helper()
	s.serve = start(s.t, s.secretEnv, s.bc, "serve", "--config", s.serveConf)
	u, err := url.Parse(logged(s.t, s.serve, apiURLRE, "the API listener"))
	must(s.t, err)
	s.api = u.Host
	switch s.o.Gateway {
	case gatewayProcess:
		s.agent = logged(s.t, s.serve, agentAddrRE, "the agent listener")
	case gatewayInServe:
		s.gw = logged(s.t, s.serve, gatewayRE, "the in-process gateway listener")
		if s.o.GatewayMetrics {
			s.gwMetrics = logged(s.t, s.serve, gatewayMetricsRE, "the in-process gateway's metrics listener")
		}
	}
	if s.o.Metrics {
		s.metrics = logged(s.t, s.serve, metricsRE, "serve's metrics listener")
	}
	s.writeServe()
}

// startGateway starts the gateway process, reads its addresses and keeps
// them in gateway.toml.
func (s *stack) startGateway() {
	s.t.Helper()
	s.writeGateway()
	s.gateway = start(s.t, nil, s.bc, "gateway", "--config", s.gatewayConf)
	s.gw = logged(s.t, s.gateway, gatewayRE, "the gateway listener")
	if s.o.GatewayMetrics {
		s.gwMetrics = logged(s.t, s.gateway, gatewayMetricsRE, "the gateway's metrics listener")
	}
	s.writeGateway()
}

// restartServe starts serve again on its addresses (after it was killed or
// stopped).
func (s *stack) restartServe() {
	s.t.Helper()
	s.serve = start(s.t, s.secretEnv, s.bc, "serve", "--config", s.serveConf)
	logged(s.t, s.serve, apiURLRE, "the restarted API")
}

// restartGateway starts the gateway process again on its address.
func (s *stack) restartGateway() {
	s.t.Helper()
	s.gateway = start(s.t, nil, s.bc, "gateway", "--config", s.gatewayConf)
	logged(s.t, s.gateway, gatewayRE, "the restarted gateway")
}

func (s *stack) writeServe() {
	s.t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "listen = %q\n", s.api)
	store := s.o.Store
	if store == "" {
		store = fmt.Sprintf("driver = \"sqlite\"\npath = %q", filepath.Join(s.dir, "bc.db"))
	}
	fmt.Fprintf(&b, "[store]\n%s\n[pki]\ndir = %q\n", store, filepath.Join(s.dir, "pki"))
	if s.o.Gateway == gatewayProcess {
		fmt.Fprintf(&b, "[agent]\nlisten = %q\ncert_file = %q\nkey_file = %q\n", s.agent, filepath.Join(s.dir, "agent.crt"), filepath.Join(s.dir, "agent.key"))
	}
	if s.o.Advertise || s.o.Gateway == gatewayInServe {
		b.WriteString("[gateway]\n")
		if s.o.Advertise {
			fmt.Fprintf(&b, "url = %q\n", "https://"+s.gw)
		}
		if s.o.Gateway == gatewayInServe {
			fmt.Fprintf(&b, "listen = %q\ncert_file = %q\nkey_file = %q\n", s.gw, filepath.Join(s.dir, "gateway.crt"), filepath.Join(s.dir, "gateway.key"))
			if s.o.GatewayMetrics {
				fmt.Fprintf(&b, "[gateway.metrics]\nlisten = %q\n", s.gwMetrics)
			}
		}
	}
	if s.o.Metrics {
		fmt.Fprintf(&b, "[metrics]\nlisten = %q\n", s.metrics)
	}
	if s.o.CertTTLSeconds != 0 {
		fmt.Fprintf(&b, "[join]\ncert_ttl_seconds = %d\n", s.o.CertTTLSeconds)
	}
	b.WriteString(s.o.ServeTOML)
	must(s.t, os.WriteFile(s.serveConf, []byte(b.String()), 0o600))
}

func (s *stack) writeGateway() {
	s.t.Helper()
	ca := s.o.GatewayCAFile
	if ca == "" {
		ca = filepath.Join(s.dir, "pki", "serving-ca.crt")
	}
	var b strings.Builder
	fmt.Fprintf(&b, "listen = %q\ncert_file = %q\nkey_file = %q\napi_url = %q\napi_ca_file = %q\n",
		s.gw, filepath.Join(s.dir, "gateway.crt"), filepath.Join(s.dir, "gateway.key"), "https://"+s.agent, ca)
	if g := s.o.GatewayTOML; g != "" {
		b.WriteString(strings.TrimRight(g, "\n") + "\n")
	}
	if s.o.GatewayMetrics {
		fmt.Fprintf(&b, "[metrics]\nlisten = %q\n", s.gwMetrics)
	}
	must(s.t, os.WriteFile(s.gatewayConf, []byte(b.String()), 0o600))
}

// cli runs the CLI against the stack with --json and returns the answer;
// a failure fails the test.
func (s *stack) cli(args ...string) map[string]any {
	s.t.Helper()
	return jsonCLI(s.t, s.bc, s.env)(args...)
}

// sitePool makes a site and a pool in it, both called name, in the
// bootstrap tenant.
func (s *stack) sitePool(name string) (site, pool string) {
	s.t.Helper()
	site = s.cli("sites", "create", name, "--tenant", s.tenant)["id"].(string)
	pool = s.cli("pools", "create", name, "--tenant", s.tenant, "--site", site)["id"].(string)
	return site, pool
}

// joinServer is `bcd join` on a host without config.toml (R11.3): it
// writes conf from the API's well-known document, the site and the pins the
// host was installed with; more are further flags.
func (s *stack) joinServer(conf, site string, more ...string) []string {
	return append([]string{"join", "--config", conf, "--server", s.apiURL, "--site", site,
		"--serving-ca-pin", s.pins["servingCaPin"].(string), "--join-signing-pin", s.pins["joinSigningKeyPin"].(string),
		"--join-encryption-pin", s.pins["joinEncryptionKeyPin"].(string)}, more...)
}
