package session

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"fmt"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// The API's own work per held session, without the transport (TLS,
// HTTP/2, the gateway): what a heartbeat costs once its bytes arrived,
// and what the held-session check costs per session per pass. Each runs
// on SQLite, and on PostgreSQL when BC_TEST_POSTGRES_DSN is set:
//
//	go test -run '^$' -bench 'Heartbeat|CheckHeld' -benchtime 2000x ./internal/controlplane/session/

// cpuTime is the CPU this process used so far (user and system, all
// threads: the work, the runtime and GC). On a shared machine the wall
// clock of a benchmark counts the waits for a core too; the CPU does not.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchStores runs fn on SQLite and PostgreSQL (skipped without its DSN).
func benchStores(b *testing.B, fn func(b *testing.B, db *store.DB)) {
	b.Run("sqlite", func(b *testing.B) { fn(b, storetest.OpenSQLite(b)) })
	b.Run("postgres", func(b *testing.B) { fn(b, storetest.OpenPostgres(b)) })
}

// benchSessions stores n connected nodes and returns a service on a fake
// clock and the sessions it would hold for them (not registered: no poll
// runs).
func benchSessions(b testing.TB, db *store.DB, n int, mac bool) (*Service, *clock.Fake, []*conn) {
	b.Helper()
	ctx := context.Background()
	fc := clock.NewFake(time.Now())
	bundle, err := ca.Generate("bench.example.com", fc.Now())
	if err != nil {
		b.Fatal(err)
	}
	issuer := bundle.TrustedNodeCAs()[0].SubjectKeyId
	s := New(Config{DB: db, Clock: fc, Bundle: bundle})
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		b.Fatal(err)
	}
	conns := make([]*conn, n)
	serial := make([]byte, 16)
	for i := range conns {
		node := storetest.Node(b, db, store.NodeAdopted)
		_, _ = rand.Read(serial)
		c := &conn{id: newSessionID(), nodeID: node.ID, tenantID: node.TenantID, generation: node.IdentityGeneration, serial: fmt.Sprintf("%x", serial),
			issuerKeyID: issuer, nodeKey: key.Public(), nonce: make([]byte, pki.SessionNonceSize), sent: map[string]struct{}{}}
		_, _ = rand.Read(c.nonce)
		if mac {
			c.mac = pki.NewHeartbeatMAC(make([]byte, pki.HeartbeatKeySize), c.nonce)
		}
		c.lastTouch = fc.Now()
		_, c.cancel = context.WithCancelCause(ctx)
		now := fc.Now()
		if err := db.WithTx(ctx, func(tx *store.Tx) error {
			if err := tx.InsertNodeCert(ctx, store.NodeCert{Serial: c.serial, NodeID: c.nodeID, IdentityGeneration: c.generation, Role: pki.RoleNode,
				SPKISHA256: make([]byte, 32), DER: []byte(c.serial), NotBefore: now, NotAfter: now.Add(24 * time.Hour), CreatedAt: now}); err != nil {
				return err
			}
			_, err := tx.ConnectNode(ctx, c.nodeID, c.id)
			return err
		}); err != nil {
			b.Fatal(err)
		}
		conns[i] = c
	}
	return s, fc, conns
}

// BenchmarkHeartbeat is the API's work for one heartbeat as it arrives:
// decoding the message, checking it (an ECDSA verification, or a MAC),
// and, every second beat (TouchEvery 30 s, a beat every 15 s), the
// transaction that records it. cpu-ns/op (this process's CPU, the store's
// included on SQLite) and allocs/op are per beat.
func BenchmarkHeartbeat(b *testing.B) {
	benchStores(b, func(b *testing.B, db *store.DB) {
		for _, mac := range []bool{false, true} {
			name := "signature"
			if mac {
				name = "mac"
			}
			b.Run(name, func(b *testing.B) {
				s, fc, conns := benchSessions(b, db, 1, mac)
				c := conns[0]
				key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
				if err != nil {
					b.Fatal(err)
				}
				c.nodeKey = key.Public()
				// The wire bytes of b.N heartbeats, made before the clock
				// runs (signing is bcd's cost, not the API's).
				msgs := make([][]byte, b.N)
				for i := range msgs {
					seq := uint64(i + 1)
					hb := &agentv1.Heartbeat{Seq: seq}
					if mac {
						hb.Mac = c.mac.Sum(seq)
					} else if hb.Sig, err = pki.SignHeartbeat(key, c.nonce, seq); err != nil {
						b.Fatal(err)
					}
					if msgs[i], err = proto.Marshal(&agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: hb}}); err != nil {
						b.Fatal(err)
					}
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.ResetTimer()
				cpu := cpuTime(b)
				defer func() { b.ReportMetric(float64((cpuTime(b)-cpu).Nanoseconds())/float64(b.N), "cpu-ns/op") }()
				for i := range b.N {
					fc.Advance(DefaultHeartbeat)
					var m agentv1.SessionClientMessage
					if err := proto.Unmarshal(msgs[i], &m); err != nil {
						b.Fatal(err)
					}
					if err := s.handle(ctx, c, &m); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	})
}

// BenchmarkCheckHeld is one full check of n held sessions against the
// database (the sweep: what every Check ran before the session change
// feed, and what runs every defaultSweep now); ns/session is its cost per
// session per pass (cpu-ns/session: this process's CPU).
func BenchmarkCheckHeld(b *testing.B) {
	benchStores(b, func(b *testing.B, db *store.DB) {
		for _, n := range []int{100, 1000} {
			b.Run(fmt.Sprint(n), func(b *testing.B) {
				s, fc, conns := benchSessions(b, db, n, true)
				s.held.sweepEvery = 0
				s.polling = true // no poll goroutine
				for _, c := range conns {
					s.register(c)
				}
				ctx := context.Background()
				b.ReportAllocs()
				b.ResetTimer()
				cpu := cpuTime(b)
				for b.Loop() {
					s.held.feed.Reset() // every session, at once
					s.checkLive(ctx, nil, fc.Now())
				}
				b.ReportMetric(float64((cpuTime(b)-cpu).Nanoseconds())/float64(b.N)/float64(n), "cpu-ns/session")
				for _, c := range conns {
					if c.reason() != "" {
						b.Fatalf("the check ended a live session: %s", c.reason())
					}
				}
			})
		}
	})
}

// BenchmarkCheck is one Check (every Check, 500 ms) of a replica holding n
// sessions, the in-memory pass over every session included:
//   - sweep: every session checked against the database at once, as
//     every Check did before the session change feed (now only when the
//     feed cannot be trusted);
//   - sweep-spread: a Check during the periodic sweep, which checks a
//     1/120 slice of the held sessions a Check (defaultSweep / Check);
//   - feed: nothing changed (one read of the feed);
//   - feed-10: another replica changed 10 held nodes since the last Check
//     (20 feed rows; the sessions stay live, so each Check checks 10);
//   - issuers: feed, plus the in-memory issuer check of every session a
//     bundle rotation triggers.
//
// ns/op and cpu-ns/op (this process's CPU: the database's too on SQLite)
// are per Check; ns/session divides ns/op by n.
//
//	go test -run '^$' -bench 'BenchmarkCheck$' -benchtime 20x -timeout 60m ./internal/controlplane/session/
func BenchmarkCheck(b *testing.B) {
	benchStores(b, func(b *testing.B, db *store.DB) {
		for _, n := range []int{10000, 100000} {
			b.Run(fmt.Sprint(n), func(b *testing.B) {
				s, fc, _ := heldService(b, db)
				conns := heldFleet(b, s, fc, n)
				ctx := context.Background()
				run := func(b *testing.B, sweepEvery time.Duration, changes int, issuers bool) {
					s.held.sweepEvery = sweepEvery
					s.checkHeld(ctx)
					s.held.sweepLeft = nil
					var cpu time.Duration
					b.ReportAllocs()
					b.ResetTimer()
					for i := range b.N {
						if changes > 0 {
							b.StopTimer()
							benchChanges(b, db, conns, i*changes, changes)
							b.StartTimer()
						}
						if issuers {
							s.held.issuers = nil
						}
						if sweepEvery == 0 {
							s.held.feed.Reset() // every session, at once
						} else if sweepEvery < time.Hour && len(s.held.sweepLeft) == 0 {
							s.held.lastSweep = time.Time{} // the next spread sweep begins
						}
						start := cpuTime(b)
						s.checkHeld(ctx)
						cpu += cpuTime(b) - start
					}
					b.StopTimer()
					b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
					b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/session")
					if st := s.held.last; st.swept != (sweepEvery == 0) || changes > 0 && st.checked != changes || sweepEvery == defaultSweep && st.sweep == 0 {
						b.Fatalf("last Check %+v", st)
					}
					for _, c := range conns {
						if c.reason() != "" {
							b.Fatalf("the check ended a live session: %s", c.reason())
						}
					}
				}
				b.Run("sweep", func(b *testing.B) { run(b, 0, 0, false) })
				b.Run("sweep-spread", func(b *testing.B) { run(b, defaultSweep, 0, false) })
				b.Run("feed", func(b *testing.B) { run(b, 24*time.Hour, 0, false) })
				b.Run("feed-10", func(b *testing.B) { run(b, 24*time.Hour, 10, false) })
				b.Run("issuers", func(b *testing.B) { run(b, 24*time.Hour, 0, true) })
			})
		}
	})
}

// benchChanges has another replica write two feed rows for each of the
// held nodes from..from+k (modulo the fleet) that leave the sessions live:
// the node connected by another session and back by its own.
func benchChanges(b *testing.B, db *store.DB, conns []*conn, from, k int) {
	ctx := context.Background()
	err := db.WithTx(ctx, func(tx *store.Tx) error {
		for j := range k {
			c := conns[(from+j)%len(conns)]
			if _, err := tx.ConnectNode(ctx, c.nodeID, "elsewhere"); err != nil {
				return err
			}
			if _, err := tx.ConnectNode(ctx, c.nodeID, c.id); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkHeartbeatFleet is BenchmarkHeartbeat with 64 sessions beating
// at once, each on its own handler goroutine as on a replica holding a
// fleet: the heartbeats due to be recorded while another handler writes
// are recorded together (touch.go). cpu-ns/op is per beat.
func BenchmarkHeartbeatFleet(b *testing.B) {
	benchStores(b, func(b *testing.B, db *store.DB) {
		const n = 64
		s, _, conns := benchSessions(b, db, n, true)
		s.cfg.Clock = clock.Real{}
		s.cfg.TouchEvery = time.Nanosecond // every beat is recorded: the write is what is measured
		var next atomic.Int64
		ctx := context.Background()
		b.ReportAllocs()
		b.SetParallelism(n / 2) // GOMAXPROCS 2 on this machine kind: 64 goroutines
		b.ResetTimer()
		cpu := cpuTime(b)
		b.RunParallel(func(pb *testing.PB) {
			c := conns[int(next.Add(1)-1)%n]
			for pb.Next() {
				seq := c.lastSeq + 1
				m := &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: &agentv1.Heartbeat{Seq: seq, Mac: c.mac.Sum(seq)}}}
				if err := s.handle(ctx, c, m); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64((cpuTime(b)-cpu).Nanoseconds())/float64(b.N), "cpu-ns/op")
	})
}
