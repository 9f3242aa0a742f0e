package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// webhookSink is a SIEM's ingest endpoint: it keeps one copy per id and
// counts every item it was sent. stop closes its listener (the SIEM is
// down); serve brings it back on the same address.
type webhookSink struct {
	t *testing.T
	// addr is where serve listens: 127.0.0.1:0 at first, then the address
	// the first serve bound.
	addr string

	mu    sync.Mutex
	srv   *http.Server
	got   map[string]map[string]any
	sent  int
	posts int
}

func (s *webhookSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	sc := bufio.NewScanner(r.Body)
	sc.Buffer(nil, 1<<24)
	var items []map[string]any
	for sc.Scan() {
		var it map[string]any
		if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		items = append(items, it)
	}
	if sc.Err() != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.posts++
	for _, it := range items {
		s.got[it["id"].(string)] = it
	}
	s.sent += len(items)
}

func (s *webhookSink) serve() {
	ln, err := net.Listen("tcp", s.addr)
	must(s.t, err)
	s.addr = ln.Addr().String()
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 5 * time.Second}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	go func() { _ = srv.Serve(ln) }()
}

func (s *webhookSink) stop() {
	s.mu.Lock()
	srv := s.srv
	s.mu.Unlock()
	_ = srv.Close()
}

func (s *webhookSink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.got)
}

// ids is what the sink has, by tenant.
func (s *webhookSink) ids() map[string][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]string{}
	for id, it := range s.got {
		tn := it["tenant"].(string)
		out[tn] = append(out[tn], id)
	}
	for _, v := range out {
		sort.Strings(v)
	}
	return out
}

// The audit export's promise with real processes: `better-compute serve`
// exports to a webhook while machines join through a gateway and
// operators create and revoke tokens; the webhook goes down mid-stream,
// the API is killed with SIGKILL and restarted (its successor takes the
// export lease over once it expired), then the webhook comes back. The
// webhook ends with every event and audit row the API lists, each once by
// id, none missing. R17.4
func TestExportSurvivesSinkOutageAndCrash(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		exportThroughFaults(t, "driver = \"sqlite\"\npath = "+fmt.Sprintf("%q", filepath.Join(t.TempDir(), "bc.db")))
	})
	t.Run("postgres", func(t *testing.T) {
		exportThroughFaults(t, fmt.Sprintf("driver = \"postgres\"\ndsn = %q\nmax_conns = 4", storetest.PostgresDSN(t)))
	})
}

const exportMachines = 30

func exportThroughFaults(t *testing.T, storeTOML string) {
	sink := &webhookSink{t: t, addr: "127.0.0.1:0", got: map[string]map[string]any{}}
	sink.serve()
	t.Cleanup(sink.stop)

	// The API keeps the ports the kernel gave it on its first start.
	st := startStack(t, stackOpts{Store: storeTOML, GatewayTOML: `request_timeout = "5s"`, ServeTOML: `[export]
interval = "100ms"
lease = "2s"
batch_size = 7
[[export.sinks]]
kind = "webhook"
url = "http://` + sink.addr + `/ingest"
allow_http_loopback = true
timeout = "1s"
`})
	bc, dir, env, tenant, cli := st.bc, st.dir, st.env, st.tenant, st.cli
	site, pool := st.sitePool("export")
	tokens := func(n int) {
		t.Helper()
		for range n {
			tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h")
			cli("join-tokens", "revoke", tok["id"].(string), "--tenant", tenant, "--pool", pool)
		}
	}
	tok := cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(exportMachines))
	sb := newStormBCD(t, dir, "https://"+st.gw, site, st.pins)
	ms := make([]*stormMachine, exportMachines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, tok["token"].(string), sb.EncKey)
	}
	// Machines join the whole time, paced so that the outage and the
	// kill land among them; each retries until it is told yes or no.
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	storm := startStorm(ctx, t, stormConfig{URL: sb.Config.GatewayURL, TLS: sb.TLS, SigningPin: sb.Config.JoinSigningKeyPin, Site: site,
		Machines: ms, Concurrency: 2, Every: 100 * time.Millisecond})
	joined := func(n int64) {
		t.Helper()
		waitFor(t, fmt.Sprintf("%d joins", n), 30*time.Second, func() bool { return storm.confirmed.Load() >= n })
	}

	tokens(2)
	joined(5)
	waitFor(t, "the first rows at the webhook", 20*time.Second, func() bool { return sink.count() > 0 })
	sink.stop()
	t.Logf("webhook down after %d rows", sink.count())
	tokens(2)
	joined(12)
	must(t, st.serve.cmd.Process.Kill())
	<-st.serve.done
	t.Logf("killed the API (SIGKILL) after %d joins", storm.confirmed.Load())
	st.restartServe()
	tokens(2)
	storm.wait()
	if ctx.Err() != nil {
		t.Fatalf("the joins did not finish: %d of %d confirmed", storm.confirmed.Load(), exportMachines)
	}
	sink.serve()

	// What the API lists, for every tenant the webhook heard of (and the
	// bootstrap's).
	listed := func() map[string][]string {
		out := map[string][]string{}
		tenants := sink.ids()
		tenants[tenant] = nil
		for tn := range tenants {
			for _, what := range []string{"events", "audit"} {
				stdout, errOut, code := run(t, env, "", bc, what, "list", "--tenant", tn, "--json")
				if code != 0 {
					t.Fatalf("%s list: %s", what, errOut)
				}
				for _, line := range strings.Split(strings.TrimSpace(stdout), "\n") {
					if line != "" {
						out[tn] = append(out[tn], jsonOf(t, line)["id"].(string))
					}
				}
			}
			sort.Strings(out[tn])
		}
		return out
	}
	var want map[string][]string
	waitFor(t, "every listed row at the webhook", 40*time.Second, func() bool {
		want = listed()
		return fmt.Sprint(sink.ids()) == fmt.Sprint(want)
	})
	n := 0
	for _, v := range want {
		n += len(v)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	t.Logf("the webhook has the %d listed rows once by id; it was sent %d items in %d posts (%d resent)", n, sink.sent, sink.posts, sink.sent-n)
	if !strings.Contains(st.serve.output(), "export lease") {
		t.Errorf("the restarted API never took the export lease")
	}
	if joinedEvents := strings.Count(fmt.Sprint(sink.got), "node.joined"); joinedEvents < exportMachines {
		t.Errorf("the webhook has %d node.joined rows, want at least %d", joinedEvents, exportMachines)
	}
}
