package api_test

import (
	"context"
	"database/sql"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R19.1: /readyz fails (503, the reason in the body) while the database
// answers reads but refuses writes (a read-only PostgreSQL: a trigger
// answers the readiness row with read_only_sql_transaction here), and is
// 200 again by itself once writes work.
func TestReadyzFailsWhileWritesFailR19_1(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	ctx := context.Background()
	db, err := store.Open(ctx, store.Config{Driver: "postgres", DSN: dsn}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	raw, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	e := apitest.Start(t, db, apitest.Options{NoJoin: true})
	readyz := func() (int, string) {
		res, err := e.HTTP.Client().Get(e.URL + "/readyz")
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		return res.StatusCode, string(b)
	}
	if code, body := readyz(); code != 200 {
		t.Fatalf("a healthy database: %d %q", code, body)
	}
	for _, q := range []string{
		`CREATE FUNCTION refuse_probe() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'read-only' USING ERRCODE = '25006'; END $$`,
		`CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON ready_probe FOR EACH ROW EXECUTE FUNCTION refuse_probe()`,
	} {
		if _, err := raw.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var code int
	var body string
	poll.UntilDetail(t, 10*time.Second, func() string { return "/readyz to fail; last " + body }, func() bool {
		code, body = readyz()
		return code == 503
	})
	if want := "database unavailable: writes fail (read-only)\n"; body != want {
		t.Errorf("body %q, want %q", body, want)
	}
	if _, err := raw.ExecContext(ctx, "DROP TRIGGER refuse ON ready_probe"); err != nil {
		t.Fatal(err)
	}
	poll.UntilDetail(t, 10*time.Second, func() string { return "/readyz to pass again; last " + body }, func() bool {
		code, body = readyz()
		return code == 200 && strings.HasPrefix(body, "ok")
	})
}
