package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// A join storm through a real gateway while the API is killed with SIGKILL
// twice and restarted, on each store. Afterwards the database must be
// whole: every use spent made exactly one node, no row belongs to a node
// that does not exist (or the other way round), no machine became two
// nodes, every join a machine was told succeeded is there, no machine that
// was plainly refused got a node, and every node.joined event is readable.
// R4.4, R4.9, R14.1
func TestCrashDuringJoinStorm(t *testing.T) {
	if testing.Short() {
		t.Skip("kills and restarts the API during a join storm (about a minute per store)")
	}
	t.Run("sqlite", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "bc.db")
		crashStorm(t, fmt.Sprintf("driver = \"sqlite\"\npath = %q\n", path), store.Config{Driver: "sqlite", Path: path})
	})
	t.Run("postgres", func(t *testing.T) {
		// Set BC_TEST_POSTGRES_DSN and a database that cannot be reached
		// fails the test.
		dsn := storetest.PostgresDSN(t)
		crashStorm(t, fmt.Sprintf("driver = \"postgres\"\ndsn = %q\nmax_conns = 8\n", dsn), store.Config{Driver: "postgres", DSN: dsn, MaxConns: 2})
	})
}

const (
	stormMachines    = 1000
	stormConcurrency = 16
	stormDeadline    = 60 * time.Second
)

// logged waits for re in p's output and returns its first group.
func logged(t *testing.T, p *proc, re *regexp.Regexp, what string) string {
	t.Helper()
	var m []string
	waitFor(t, what, 30*time.Second, func() bool {
		m = re.FindStringSubmatch(p.output())
		return m != nil
	})
	return m[1]
}

// stormMachine is one simulated machine and what it was told.
type stormMachine struct {
	key  *ecdsa.PrivateKey
	csr  []byte
	req  *agentv1.JoinRequest
	host string

	nodeID    string // the answer it verified, if any
	refused   bool   // ACCESS_DENIED
	ambiguous bool   // an answer that says neither (UNAVAILABLE, transport error, ...)
	lastErr   string
	errAt     []time.Time // when it got an error (startStorm)
}

func crashStorm(t *testing.T, storeTOML string, check store.Config) {
	// The API takes its ports from the kernel on the first start and keeps
	// them on every restart: the gateway knows it by that address.
	st := startStack(t, stackOpts{Store: storeTOML, GatewayTOML: `request_timeout = "5s"`})
	dir, tenant := st.dir, st.tenant
	site, pool := st.sitePool("crash")
	tok := st.cli("join-tokens", "create", "--tenant", tenant, "--pool", pool, "--ttl", "1h", "--max-uses", fmt.Sprint(stormMachines))
	token, tokenID := tok["token"].(string), tok["id"].(string)

	sb := newStormBCD(t, dir, "https://"+st.gw, site, st.pins)
	bcfg, encKey, tlsConf := sb.Config, sb.EncKey, sb.TLS

	ms := make([]*stormMachine, stormMachines)
	for i := range ms {
		ms[i] = prepareMachine(t, i, token, encKey)
	}

	// The storm: every machine tries until it is told yes or no, retrying
	// the same request after anything else (the API is down, the gateway
	// timed out, the outcome is unknown).
	ctx, cancel := context.WithTimeout(context.Background(), stormDeadline)
	defer cancel()
	storm := startStorm(ctx, t, stormConfig{URL: bcfg.GatewayURL, TLS: tlsConf, SigningPin: bcfg.JoinSigningKeyPin, Site: site,
		Machines: ms, Concurrency: stormConcurrency})
	confirmed := &storm.confirmed

	// Kill the API twice, mid-storm, and bring it back on the same ports.
	for _, at := range []int64{stormMachines / 4, stormMachines / 2} {
		waitFor(t, fmt.Sprintf("%d confirmed joins", at), stormDeadline, func() bool { return confirmed.Load() >= at })
		must(t, st.serve.cmd.Process.Kill())
		<-st.serve.done
		t.Logf("killed the API (SIGKILL) after %d confirmed joins", confirmed.Load())
		st.restartServe()
	}
	storm.wait()
	if ctx.Err() != nil {
		t.Fatalf("the storm did not finish within %v", stormDeadline)
	}
	refused, ambiguous := stormCounts(ms)
	t.Logf("%d machines: %d confirmed, %d refused, %d saw an answer that was neither", len(ms), confirmed.Load(), refused, ambiguous)

	// Stop the API cleanly, then look at what it left.
	must(t, st.serve.cmd.Process.Signal(os.Interrupt))
	<-st.serve.done
	checkStormInvariants(t, check, tenant, tokenID, ms, 0)
}

// prepareMachine makes machine i's key, CSR, distinct claims and a token
// sealed to its CSR.
func prepareMachine(t *testing.T, i int, token string, encKey *ecdsa.PublicKey) *stormMachine {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	csr, err := identity.NewCSR(key, "crash")
	must(t, err)
	h := sha256.Sum256([]byte(fmt.Sprintf("crash/%d", i)))
	host := fmt.Sprintf("crash-%04d", i)
	req := &agentv1.JoinRequest{
		Csr: csr, Protocol: version.ProtocolMax,
		Claims: &agentv1.Claims{
			ProductUuid:   fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16]),
			ProductSerial: fmt.Sprintf("CR-%06d", i),
			Macs:          []string{fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", h[16]&0xfc, h[17], h[18], h[19], h[20], h[21])},
			Hostname:      host,
		},
	}
	// Sealed as bcd seals: bound to the whole request (R4.2).
	sealed, err := pki.Seal(encKey, token, csr, pki.JoinRequestDigest(req), time.Now())
	must(t, err)
	req.SealedToken = sealed
	return &stormMachine{key: key, csr: csr, host: host, req: req}
}

// checkStormInvariants checks the database after a storm of ms, all with
// tokenID; others is the number of other nodes in the database (joined
// with other tokens), which the checks on all nodes count in.
func checkStormInvariants(t *testing.T, cfg store.Config, tenant, tokenID string, ms []*stormMachine, others int) {
	ctx := context.Background()
	db, err := store.Open(ctx, cfg, nil)
	if err != nil {
		t.Fatalf("open the store after the storm: %v", err)
	}
	defer db.Close()

	// Uses spent = nodes made with the token.
	var usesLeft int
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		jt, err := tx.GetJoinToken(ctx, tokenID)
		usesLeft = jt.UsesLeft
		return err
	}); err != nil {
		t.Fatal(err)
	}

	driver, dsn := "sqlite", "file:"+cfg.Path
	if cfg.Driver == "postgres" {
		driver, dsn = "pgx", cfg.DSN
	}
	raw, err := sql.Open(driver, dsn)
	must(t, err)
	defer raw.Close()
	count := func(q string, args ...any) int {
		t.Helper()
		if driver == "pgx" {
			for n := 1; strings.Contains(q, "?"); n++ {
				q = strings.Replace(q, "?", fmt.Sprintf("$%d", n), 1)
			}
		}
		var n int
		if err := raw.QueryRowContext(ctx, q, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return n
	}
	nodes := count("SELECT COUNT(*) FROM nodes WHERE join_token_id = ?", tokenID)
	if all := count("SELECT COUNT(*) FROM nodes"); all != nodes+others {
		t.Errorf("%d nodes, %d of them from the storm's token and %d others expected", all, nodes, others)
	}
	if spent := len(ms) - usesLeft; spent != nodes {
		t.Errorf("uses spent %d, nodes made %d", spent, nodes)
	}
	for q, what := range map[string]string{
		"SELECT COUNT(*) FROM node_certs c WHERE NOT EXISTS (SELECT 1 FROM nodes n WHERE n.id = c.node_id)": "certificates without a node",
		"SELECT COUNT(*) FROM work_queue w WHERE NOT EXISTS (SELECT 1 FROM nodes n WHERE n.id = w.node_id)": "work without a node",
		"SELECT COUNT(*) FROM nodes n WHERE NOT EXISTS (SELECT 1 FROM node_certs c WHERE c.node_id = n.id)": "nodes without a certificate",
		// A previous release's replica (TestRollingUpgrade) writes node_authz instead of authz_ms.
		"SELECT COUNT(*) FROM nodes n WHERE authz_ms IS NULL AND NOT EXISTS (SELECT 1 FROM node_authz a WHERE a.node_id = n.id)": "nodes without an authorization projection",
	} {
		if n := count(q); n != 0 {
			t.Errorf("%d %s", n, what)
		}
	}
	if n := count("SELECT COUNT(*) FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE n.join_token_id = ?", tokenID); n != nodes {
		t.Errorf("%d certificates for %d nodes (one each)", n, nodes)
	}
	if n := count("SELECT COUNT(DISTINCT hostname) FROM nodes WHERE join_token_id = ?", tokenID); n != nodes {
		t.Errorf("%d machines became %d nodes", n, nodes)
	}
	if n := count("SELECT COUNT(*) FROM audit WHERE tenant_id = ? AND action = 'node.joined'", tenant); n != nodes+others {
		t.Errorf("%d node.joined audit rows for %d nodes", n, nodes+others)
	}

	// Every confirmed join is there, under the node id the machine was
	// given; a machine plainly refused (never an unclear answer) has no
	// node.
	byHost := map[string]string{}
	q := "SELECT hostname, id FROM nodes WHERE join_token_id = ?"
	if driver == "pgx" {
		q = strings.Replace(q, "?", "$1", 1)
	}
	rows, err := raw.QueryContext(ctx, q, tokenID)
	must(t, err)
	for rows.Next() {
		var h, id string
		must(t, rows.Scan(&h, &id))
		byHost[h] = id
	}
	must(t, rows.Err())
	rows.Close()
	unconfirmed := 0
	for i, m := range ms {
		id, has := byHost[m.host]
		if has && m.nodeID == "" {
			unconfirmed++
		}
		switch {
		case m.nodeID != "" && id != m.nodeID:
			t.Errorf("machine %d was told it joined as %s; the database has %q", i, m.nodeID, id)
		case m.nodeID == "" && m.refused && !m.ambiguous && has:
			t.Errorf("machine %d was refused, yet node %s was made for it", i, id)
		case m.nodeID == "" && !m.refused:
			t.Errorf("machine %d never got an answer (last: %s)", i, m.lastErr)
		case m.refused:
			// R4.9: a machine whose answer was lost with the API resends
			// the very same request and gets the answer stored for it;
			// with as many uses as machines, nobody is refused.
			t.Errorf("machine %d was refused (R4.9: its retry must get the stored answer)", i)
		}
	}
	if unconfirmed != 0 {
		t.Errorf("%d nodes for machines never told so: a retry did not get its stored answer (R4.9)", unconfirmed)
	}

	// Every node.joined event is readable, including those committed right
	// before a kill (on PostgreSQL the restarted API numbers them).
	if err := db.WaitEventsVisible(ctx, tenant, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	joined := 0
	var atx, aid int64
	for {
		var evs []store.Event
		if err := db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			evs, err = tx.ListEvents(ctx, tenant, atx, aid, "node.joined", 200)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if len(evs) == 0 {
			break
		}
		joined += len(evs)
		atx, aid, _ = store.ParseEventCursor(evs[len(evs)-1].Cursor())
	}
	if joined != nodes+others {
		t.Errorf("%d node.joined events readable for %d nodes", joined, nodes+others)
	}
}
