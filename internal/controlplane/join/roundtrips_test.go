package join_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/checks/poll"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// maxJoinRoundTrips is what a join costs PostgreSQL in round trips: BEGIN
// with the token read, the pool, the hardware key, the node, one batch of
// the held-back inserts, the stored answer and the spend, and COMMIT.
// It was 8 while BEGIN and the spend had round trips of their own.
const maxJoinRoundTrips = 6

// maxJoinStatements is how many statements a join's transaction runs
// (BEGIN and COMMIT aside) in a pool without acceptance checks: the token,
// the pool and the hardware-key reads, the node, its certificate, its
// events (node.joined and node.adopted in one insert), its audit rows (in
// another), the stored answer and the spend. It was 11 while each event
// and audit row had an insert of its own.
const maxJoinStatements = 9

// tripCounter is a pgx tracer that counts the round trips of each
// transaction of each connection: every query or batch pgx sends and
// waits for, and every statement it prepares first (a statement not yet
// in a connection's cache), from the one that begins the transaction to
// its COMMIT or ROLLBACK.
type tripCounter struct {
	mu   sync.Mutex
	open map[*pgx.Conn]*txTrips
	done []*txTrips
}

// txTrips is one transaction as tripCounter saw it.
type txTrips struct {
	trips int
	sql   []string
}

func (c *tripCounter) sent(conn *pgx.Conn, sqls ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	tx := c.open[conn]
	if tx == nil && len(sqls) > 0 && strings.EqualFold(strings.TrimSpace(sqls[0]), "begin") {
		tx = &txTrips{}
		c.open[conn] = tx
	}
	if tx == nil {
		return
	}
	tx.trips++
	tx.sql = append(tx.sql, sqls...)
	last := strings.ToLower(strings.TrimSpace(sqls[len(sqls)-1]))
	if last == "commit" || last == "rollback" {
		c.done = append(c.done, tx)
		delete(c.open, conn)
	}
}

// prepared counts a prepare inside an open transaction.
func (c *tripCounter) prepared(conn *pgx.Conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if tx := c.open[conn]; tx != nil {
		tx.trips++
	}
}

func (c *tripCounter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.sent(conn, d.SQL)
	return ctx
}

func (c *tripCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *tripCounter) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	sqls := make([]string, len(d.Batch.QueuedQueries))
	for i, q := range d.Batch.QueuedQueries {
		sqls[i] = q.SQL
	}
	c.sent(conn, sqls...)
	return ctx
}

func (c *tripCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (c *tripCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *tripCounter) TracePrepareStart(ctx context.Context, conn *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepared(conn)
	return ctx
}

func (c *tripCounter) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// joins returns the transactions that stored a join's answer, and
// forgets every transaction seen so far.
func (c *tripCounter) joins() []*txTrips {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*txTrips
	for _, tx := range c.done {
		for _, q := range tx.sql {
			if strings.Contains(q, "INSERT INTO join_answers") {
				out = append(out, tx)
				break
			}
		}
	}
	c.done = nil
	return out
}

// R4.4: a join is one transaction, and on PostgreSQL it costs at most
// maxJoinRoundTrips round trips once the connection has prepared its
// statements, and runs at most maxJoinStatements statements (counted by a
// pgx tracer on the store's own connections).
func TestJoinRoundTripsR4_4(t *testing.T) {
	cfg, err := pgx.ParseConfig(storetest.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	counter := &tripCounter{open: map[*pgx.Conn]*txTrips{}}
	cfg.Tracer = counter
	name := stdlib.RegisterConnConfig(cfg)
	t.Cleanup(func() { stdlib.UnregisterConnConfig(name) })
	// One connection: every join runs on the connection that prepared the
	// statements of the one before.
	db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: name, MaxConns: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e := apitest.Start(t, db, apitest.Options{})
	f := newFixture(t, e)
	tok := f.token(t, &bcv1.CreateJoinTokenRequest{MaxUses: 10})
	for i := range 3 {
		req := jointest.NewMachine(t, jointest.Claims(130000+i)).Request(t, e.Bundle, tok.Token, "")
		counter.joins()
		if _, err := f.svc.Join(context.Background(), req, join.Peer{}); err != nil {
			t.Fatal(err)
		}
		joins := counter.joins()
		if len(joins) != 1 {
			t.Fatalf("join %d: %d transactions stored an answer, want 1", i, len(joins))
		}
		if i == 0 {
			continue // the connection prepared its statements
		}
		if got := joins[0].trips; got > maxJoinRoundTrips {
			t.Errorf("join %d: %d round trips, want at most %d:\n%s", i, got, maxJoinRoundTrips, strings.Join(joins[0].sql, "\n"))
		} else {
			t.Logf("join %d: %d round trips", i, got)
		}
		statements := 0
		for _, q := range joins[0].sql {
			switch strings.ToLower(strings.TrimSpace(q)) {
			case "begin", "commit", "rollback":
			default:
				statements++
			}
		}
		if statements > maxJoinStatements {
			t.Errorf("join %d: %d statements, want at most %d:\n%s", i, statements, maxJoinStatements, strings.Join(joins[0].sql, "\n"))
		}
	}
}

// R4.4: on PostgreSQL the spend goes in one batch with the stored answer
// and the held-back inserts; when it finds no use left (here another
// transaction spends the last use while the join waits on its slot), the
// join is refused exactly as before and nothing of it is written: no node,
// no stored answer, no node.joined event, the use not spent twice.
func TestFailedSpendWritesNothingR4_4(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	db, err := store.Open(context.Background(), store.Config{Driver: "postgres", DSN: dsn}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	e := apitest.Start(t, db, apitest.Options{})
	f := newFixture(t, e)
	ctx := context.Background()
	tok := f.token(t, &bcv1.CreateJoinTokenRequest{TenantId: f.acme, PoolId: f.acmePool.Id, MaxUses: 1})

	other, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	blocker, err := other.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = blocker.Rollback() }()
	if _, err := blocker.ExecContext(ctx, "UPDATE join_token_slots SET uses_left = 0 WHERE token_id = $1", tok.Id); err != nil {
		t.Fatal(err)
	}
	var blockerPID int
	if err := blocker.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&blockerPID); err != nil {
		t.Fatal(err)
	}

	req := jointest.NewMachine(t, jointest.Claims(140000)).Request(t, e.Bundle, tok.Token, "")
	res := make(chan error, 1)
	go func() {
		_, err := f.svc.Join(ctx, req, join.Peer{})
		res <- err
	}()
	// The join read a live token and now waits for the slot the blocker
	// holds, its spend sent with the answer.
	poll.UntilDetail(t, 10*time.Second, func() string { return "the join's spend to wait for the slot" }, func() bool {
		var n int
		err := other.QueryRowContext(ctx, `SELECT COUNT(*) FROM pg_stat_activity
			WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE 'UPDATE join_token_slots%'`, blockerPID).Scan(&n)
		return err == nil && n > 0
	})
	if err := blocker.Commit(); err != nil {
		t.Fatal(err)
	}
	jointest.WantRefused(t, <-res)

	if n := len(f.nodes(t, f.acme)); n != 0 {
		t.Errorf("%d nodes after a refused join, want 0", n)
	}
	f.read(t, func(tx *store.Tx) error {
		if _, err := tx.GetJoinAnswer(ctx, pki.JoinRequestDigest(req)); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("stored answer of a refused join: err = %v, want not found", err)
		}
		return nil
	})
	if evs := f.events(t, f.acme, "node.joined"); len(evs) != 0 {
		t.Errorf("%d node.joined events after a refused join, want 0", len(evs))
	}
	if left := f.usesLeft(t, tok.Id); left != 0 {
		t.Errorf("uses left %d, want 0 (the blocker's spend only)", left)
	}
}
