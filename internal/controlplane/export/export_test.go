package export_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/export"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/backoff"
)

// fakeSink is a webhook receiver that keeps one copy per id, as a SIEM
// deduping on the id does, and counts what it was sent.
type fakeSink struct {
	t *testing.T
	// fault decides the answer to the n-th POST (from 1): "" takes the
	// batch; "500" answers 500 without taking it; "lost" takes it and
	// answers 500 (the acknowledgement is lost); "hang" never answers.
	fault func(n int) string
	// check inspects each request's headers and body.
	check func(r *http.Request, body []byte)

	mu    sync.Mutex
	posts int
	sent  int // items received in batches taken
	got   map[string]export.Item
}

func (f *fakeSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	if f.check != nil {
		f.check(r, body)
	}
	f.mu.Lock()
	f.posts++
	fault := ""
	if f.fault != nil {
		fault = f.fault(f.posts)
	}
	f.mu.Unlock()
	switch fault {
	case "hang":
		<-r.Context().Done()
		return
	case "500":
		http.Error(w, "down", http.StatusInternalServerError)
		return
	}
	var items []export.Item
	if strings.HasPrefix(r.Header.Get("Content-Type"), "application/json") {
		if err := json.Unmarshal(body, &items); err != nil {
			f.t.Errorf("array batch: %v", err)
		}
	} else {
		sc := bufio.NewScanner(strings.NewReader(string(body)))
		sc.Buffer(nil, 1<<24)
		for sc.Scan() {
			var it export.Item
			if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
				f.t.Errorf("line %q: %v", sc.Text(), err)
			}
			items = append(items, it)
		}
	}
	f.mu.Lock()
	for _, it := range items {
		f.got[it.ID] = it
	}
	f.sent += len(items)
	f.mu.Unlock()
	if fault == "lost" {
		http.Error(w, "lost", http.StatusInternalServerError)
	}
}

func (f *fakeSink) ids() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.got))
	for id := range f.got {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

func newFakeSink(t *testing.T, f *fakeSink) *httptest.Server {
	f.t, f.got = t, map[string]export.Item{}
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	return srv
}

// produce commits n changes in each tenant, each an event and an audit
// row, as domain packages write them.
func produce(t *testing.T, db *store.DB, hub *events.Hub, n int, tenants ...string) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		for _, tenant := range tenants {
			err := db.WithTx(ctx, func(tx *store.Tx) error {
				data := map[string]any{"i": i}
				if err := events.Publish(ctx, tx, hub, events.Event{TenantID: tenant, Type: "test.thing.done", Subject: fmt.Sprint("thing/", i), Data: data}); err != nil {
					return err
				}
				return events.Audit(ctx, tx, events.Entry{TenantID: tenant, Actor: "system", Action: "thing.done", Resource: "thing/" + fmt.Sprint(i), Data: data})
			})
			if err != nil {
				t.Fatal(err)
			}
		}
	}
}

// listed is every id the API's ListEvents and ListAudit give the tenants'
// rows.
func listed(t *testing.T, db *store.DB, codec *events.Codec, tenants ...string) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	for _, tenant := range tenants {
		if err := db.WaitEventsVisible(ctx, tenant, 10*time.Second); err != nil {
			t.Fatal(err)
		}
		err := db.ReadTx(ctx, func(tx *store.Tx) error {
			evs, err := tx.ListEvents(ctx, tenant, 0, 0, "", 10000)
			for _, e := range evs {
				out = append(out, codec.EventCursor(tenant, e.TxOrder, e.ID))
			}
			if err != nil {
				return err
			}
			aus, err := tx.ListAuditAfter(ctx, tenant, 0, 10000)
			for _, a := range aus {
				out = append(out, codec.AuditCursor(tenant, a.ID))
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	sort.Strings(out)
	return out
}

func codecOf(t *testing.T, db *store.DB) *events.Codec {
	t.Helper()
	c, err := events.NewCodec(db.StreamKey())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// start runs an exporter of cfg until the test ends or stop is called.
func start(t *testing.T, cfg export.Config) (e *export.Exporter, stop func()) {
	t.Helper()
	if cfg.Interval == 0 {
		cfg.Interval = 20 * time.Millisecond
	}
	if cfg.Lease == 0 {
		cfg.Lease = 3 * time.Second
	}
	cfg.Retry = backoff.Policy{Min: 10 * time.Millisecond, Max: 100 * time.Millisecond}
	for i := range cfg.Sinks {
		// The fake sinks are plain httptest servers on 127.0.0.1.
		cfg.Sinks[i].AllowHTTPLoopback = strings.HasPrefix(cfg.Sinks[i].URL, "http://")
	}
	if cfg.Log == nil && os.Getenv("EXPORT_DEBUG") != "" {
		cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	e, err := export.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); e.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return e, stop
}

// waitFor polls cond for up to 15 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, 15*time.Second, what, cond)
}

// caughtUp reports whether the sink's committed position is past every
// event and audit row.
func caughtUp(t *testing.T, db *store.DB, sink string) bool {
	ctx := context.Background()
	var rest int
	if err := db.ReadTx(ctx, func(tx *store.Tx) error {
		p, err := tx.ReadExportPosition(ctx, sink)
		if err != nil {
			return err
		}
		evs, err := tx.ExportEvents(ctx, p.EventOrder, p.EventID, 1)
		if err != nil {
			return err
		}
		aus, err := tx.ExportAuditRows(ctx, p.AuditOrder, p.AuditID, 1)
		rest = len(evs) + len(aus)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return rest == 0
}

func equal(a, b []string) bool {
	return strings.Join(a, ",") == strings.Join(b, ",")
}

// R17.4: whatever the webhook does (refuse, lose the acknowledgement,
// hang past the timeout), it ends with every event and audit row once by
// id, under the id the API lists it, none missing, each item as the API
// lists its row.
func TestWebhookDeliversThroughFaults(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fault func(n int) string
		sink  export.SinkConfig
	}{
		{name: "healthy"},
		{name: "refuses", fault: func(n int) string { return map[bool]string{true: "500"}[n <= 3] }},
		{name: "loses acknowledgements", fault: func(n int) string { return map[bool]string{true: "lost"}[n%2 == 1] }},
		{name: "hangs", fault: func(n int) string { return map[bool]string{true: "hang"}[n <= 2] },
			sink: export.SinkConfig{Timeout: 100 * time.Millisecond}},
		{name: "array batches", sink: export.SinkConfig{Format: "array"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			codec := codecOf(t, db)
			f := &fakeSink{fault: tc.fault}
			srv := newFakeSink(t, f)
			produce(t, db, nil, 7, "ten_a", "ten_b")
			sc := tc.sink
			sc.Kind, sc.URL = "webhook", srv.URL
			start(t, export.Config{DB: db, Codec: codec, BatchSize: 5, Sinks: []export.SinkConfig{sc}})
			want := listed(t, db, codec, "ten_a", "ten_b")
			if len(want) != 28 {
				t.Fatalf("listed %d rows, want 28", len(want))
			}
			waitFor(t, "every row at the sink", func() bool { return equal(f.ids(), want) })
			f.mu.Lock()
			defer f.mu.Unlock()
			for _, it := range f.got {
				var row struct{ ID, TenantID string }
				raw := it.Event
				if it.Kind == export.KindAudit {
					raw = it.Audit
				}
				if err := json.Unmarshal(raw, &row); err != nil || row.ID != it.ID || row.TenantID != it.Tenant || it.Type == "" || it.Time == "" {
					t.Fatalf("item %+v does not carry its row as the API lists it (%v)", it, err)
				}
			}
		})
	}
}

// R17.4: the secret file's secret authenticates each batch, as a bearer
// token or as an HMAC of the body.
func TestWebhookAuthenticates(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, auth := range []string{"bearer", "hmac"} {
		t.Run(auth, func(t *testing.T) {
			db := storetest.OpenSQLite(t)
			codec := codecOf(t, db)
			var bad sync.Once
			f := &fakeSink{}
			f.check = func(r *http.Request, body []byte) {
				ok := r.Header.Get("Authorization") == "Bearer s3cret"
				if auth == "hmac" {
					m := hmac.New(sha256.New, []byte("s3cret"))
					m.Write(body)
					ok = r.Header.Get("X-Better-Compute-Signature") == "sha256="+hex.EncodeToString(m.Sum(nil)) && r.Header.Get("Authorization") == ""
				}
				if !ok || r.Header.Get("Idempotency-Key") == "" {
					bad.Do(func() { t.Errorf("batch headers %v", r.Header) })
				}
			}
			srv := newFakeSink(t, f)
			produce(t, db, nil, 2, "ten_a")
			start(t, export.Config{DB: db, Codec: codec, Sinks: []export.SinkConfig{{Kind: "webhook", URL: srv.URL, SecretFile: secret, Auth: auth}}})
			want := listed(t, db, codec, "ten_a")
			waitFor(t, "every row at the sink", func() bool { return equal(f.ids(), want) })
		})
	}
}

// R17.4: the file sink appends each row as a JSON line; a restarted
// exporter resumes after what was written, so with clean stops the file
// has every row exactly once. Each sink keeps its own position: an events
// only sink takes no audit rows.
func TestFileSinkResumes(t *testing.T) {
	db := storetest.OpenSQLite(t)
	codec := codecOf(t, db)
	dir := t.TempDir()
	all, evOnly := filepath.Join(dir, "all.jsonl"), filepath.Join(dir, "events.jsonl")
	cfg := export.Config{DB: db, Codec: codec, BatchSize: 4, Sinks: []export.SinkConfig{
		{Kind: "file", Path: all}, {Kind: "file", Path: evOnly, Kinds: []string{"events"}}}}
	lines := func(path string) []string {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil
		}
		var out []string
		for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			var it export.Item
			if err := json.Unmarshal([]byte(l), &it); err != nil {
				t.Fatalf("line %q: %v", l, err)
			}
			out = append(out, it.ID)
		}
		sort.Strings(out)
		return out
	}
	onlyEvents := func(ids []string) []string {
		var out []string
		for _, id := range ids {
			if strings.HasPrefix(id, "ev_") {
				out = append(out, id)
			}
		}
		return out
	}
	produce(t, db, nil, 5, "ten_a")
	_, stop := start(t, cfg)
	want := listed(t, db, codec, "ten_a")
	waitFor(t, "the first rows in the files", func() bool {
		return equal(lines(all), want) && equal(lines(evOnly), onlyEvents(want))
	})
	stop()
	produce(t, db, nil, 5, "ten_b")
	start(t, cfg)
	want = listed(t, db, codec, "ten_a", "ten_b")
	waitFor(t, "every row once in the files", func() bool {
		return equal(lines(all), want) && equal(lines(evOnly), onlyEvents(want))
	})
}

// R17.4: two exporters on one database (two replicas): one holds the lease
// and delivers, the other waits; when the holder stops, the other takes
// over from the committed position, and the sink has every row.
func TestOneExporterAtATime(t *testing.T) {
	for _, d := range []string{"sqlite", "postgres"} {
		t.Run(d, func(t *testing.T) {
			var a, b *store.DB
			if d == "sqlite" {
				a = storetest.OpenSQLite(t)
				b = a
			} else {
				r := storetest.PostgresReplicas(t, 2)
				a, b = r[0], r[1]
			}
			f := &fakeSink{}
			srv := newFakeSink(t, f)
			sinks := []export.SinkConfig{{Kind: "webhook", URL: srv.URL}}
			ea, stopA := start(t, export.Config{DB: a, Codec: codecOf(t, a), Holder: "replica-a", Sinks: sinks})
			waitFor(t, "a to hold the lease", ea.Holding)
			eb, _ := start(t, export.Config{DB: b, Codec: codecOf(t, b), Holder: "replica-b", Sinks: sinks, Lease: time.Second})
			produce(t, a, nil, 5, "ten_a")
			want := listed(t, a, codecOf(t, a), "ten_a")
			waitFor(t, "a's rows at the sink", func() bool { return equal(f.ids(), want) })
			if eb.Holding() {
				t.Fatal("b holds the lease while a does")
			}
			// Stopped once a committed what the sink took: stopping it
			// mid-batch may resend that batch (at least once), which is
			// not what this test is about.
			waitFor(t, "a to commit its position", func() bool { return caughtUp(t, a, "webhook:"+srv.URL) })
			stopA()
			waitFor(t, "b to take the lease", eb.Holding)
			produce(t, b, nil, 5, "ten_b")
			want = listed(t, b, codecOf(t, b), "ten_a", "ten_b")
			waitFor(t, "every row at the sink", func() bool { return equal(f.ids(), want) })
			f.mu.Lock()
			defer f.mu.Unlock()
			if f.sent != len(want) {
				t.Fatalf("the sink was sent %d items for %d rows: both replicas delivered", f.sent, len(want))
			}
		})
	}
}

// R17.4: with ca_file a webhook's server must chain to those CAs: with
// another CA's file the server is refused and takes nothing; with its own
// CA's it takes everything.
func TestWebhookCAFile(t *testing.T) {
	db := storetest.OpenSQLite(t)
	codec := codecOf(t, db)
	f := &fakeSink{}
	f.t, f.got = t, map[string]export.Item{}
	srv := httptest.NewTLSServer(f)
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	ca, otherCA := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "other-ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "another CA"}, IsCA: true, BasicConstraintsValid: true,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(otherCA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	produce(t, db, nil, 2, "ten_a")
	var refused bytes.Buffer
	var mu sync.Mutex
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return refused.Write(p)
	}), nil))
	start(t, export.Config{DB: db, Codec: codec, Log: log, Sinks: []export.SinkConfig{
		{Kind: "webhook", Name: "wrong-ca", URL: srv.URL, CAFile: otherCA},
		{Kind: "webhook", Name: "right-ca", URL: srv.URL, CAFile: ca}}})
	want := listed(t, db, codec, "ten_a")
	waitFor(t, "the right CA's server to take every row", func() bool { return equal(f.ids(), want) })
	waitFor(t, "the wrong CA's server to be refused", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return strings.Contains(refused.String(), "sink=wrong-ca") && strings.Contains(refused.String(), "certificate")
	})
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.sent != len(want) {
		t.Fatalf("the servers were sent %d items for %d rows: the wrong CA's server took some", f.sent, len(want))
	}
}

type writerFunc func([]byte) (int, error)

func (w writerFunc) Write(p []byte) (int, error) { return w(p) }
