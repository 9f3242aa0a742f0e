package join_test

import (
	"bytes"
	"context"
	"crypto"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/apitest"
	"github.com/better-compute/better-compute/internal/controlplane/join"
	"github.com/better-compute/better-compute/internal/controlplane/join/attest/tpm"
	"github.com/better-compute/better-compute/internal/controlplane/join/jointest"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/tpmdevice"
	"github.com/better-compute/better-compute/internal/node/tpmdevice/tpmtest"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// eachStore runs fn on a fresh API and fixture on SQLite and on PostgreSQL.
func eachStore(b *testing.B, fn func(b *testing.B, e *apitest.Env, f *fixture)) {
	for _, d := range []struct {
		name string
		open func(testing.TB) *store.DB
	}{{"sqlite", storetest.OpenSQLite}, {"postgres", storetest.OpenPostgres}} {
		b.Run(d.name, func(b *testing.B) {
			e := apitest.Start(b, d.open(b), apitest.Options{})
			fn(b, e, newFixture(b, e))
		})
	}
}

// machineSeq numbers benchmark machines so every join is a new machine.
var machineSeq atomic.Int64

// BenchmarkJoin admits distinct machines with one many-use token through
// the in-process JoinService (the whole admission transaction, signing and
// the signed answer), serially and from parallel callers, on each store.
// The daemon's side (key, CSR, seal) is made before the timer starts.
func BenchmarkJoin(b *testing.B) {
	eachStore(b, func(b *testing.B, e *apitest.Env, f *fixture) {
		svc := f.svc
		ctx := context.Background()
		prepare := func(b *testing.B) []*agentv1.JoinRequest {
			tok := f.token(b, &bcv1.CreateJoinTokenRequest{MaxUses: 100000})
			reqs := make([]*agentv1.JoinRequest, b.N)
			for i := range reqs {
				reqs[i] = jointest.NewMachine(b, jointest.Claims(int(machineSeq.Add(1)))).Request(b, e.Bundle, tok.Token, "")
			}
			return reqs
		}
		b.Run("serial", func(b *testing.B) {
			reqs := prepare(b)
			cpu := startCPU(b)
			for i := 0; i < b.N; i++ {
				if _, err := svc.Join(ctx, reqs[i], join.Peer{}); err != nil {
					b.Fatal(err)
				}
			}
			cpu.report(b)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "joins/s")
		})
		b.Run("parallel", func(b *testing.B) {
			reqs := prepare(b)
			var next atomic.Int64
			b.SetParallelism(4)
			cpu := startCPU(b)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := svc.Join(ctx, reqs[next.Add(1)-1], join.Peer{}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			cpu.report(b)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "joins/s")
		})
	})
}

// BenchmarkRenew renews distinct nodes once each through the in-process
// JoinService (R13: the certificate and node check, the proof, the used
// proof row, supersession, the new certificate, event, audit and the
// signed answer), the connection's certificate being the renewed one. The
// joins and the renewal requests are made before the timer starts.
func BenchmarkRenew(b *testing.B) {
	eachStore(b, func(b *testing.B, e *apitest.Env, f *fixture) {
		svc := f.svc
		ctx := context.Background()
		b.Run("serial", func(b *testing.B) {
			tok := f.token(b, &bcv1.CreateJoinTokenRequest{MaxUses: 100000})
			reqs := make([]*agentv1.RenewRequest, b.N)
			for i := range reqs {
				m := jointest.NewMachine(b, jointest.Claims(int(machineSeq.Add(1))))
				res, err := svc.Join(ctx, m.Request(b, e.Bundle, tok.Token, ""), join.Peer{})
				if err != nil {
					b.Fatal(err)
				}
				j := m.Verify(b, e.Bundle, res, "")
				reqs[i], _ = jointest.RenewRequest(b, m.Key, j.Body.GetCertChain(), j.Body.GetNodeId(), time.Now())
			}
			cpu := startCPU(b)
			for _, r := range reqs {
				if _, err := svc.Renew(ctx, r, join.Peer{Cert: r.Chain[0]}); err != nil {
					b.Fatal(err)
				}
			}
			cpu.report(b)
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "renewals/s")
		})
	})
}

// cpuMeter measures the process's CPU time (user and system, every
// goroutine: the SQLite writer, GC) over a benchmark's timed loop, and,
// where PostgreSQL runs on this machine, its processes' CPU time. On a
// shared machine wall time per op mostly measures the neighbours; CPU per
// op is what a change moves.
type cpuMeter struct{ start, pgStart time.Duration }

// startCPU collects the garbage of the preparation, resets the timer and
// starts measuring.
func startCPU(b *testing.B) *cpuMeter {
	runtime.GC()
	b.ResetTimer()
	return &cpuMeter{start: processCPU(b), pgStart: postgresCPU()}
}

// report adds cpu-us/op (process CPU per operation) and, when PostgreSQL's
// processes are readable here and spent anything on a PostgreSQL
// benchmark, pg-cpu-us/op.
func (m *cpuMeter) report(b *testing.B) {
	b.ReportMetric(float64((processCPU(b)-m.start).Microseconds())/float64(b.N), "cpu-us/op")
	if pg := postgresCPU() - m.pgStart; pg > 0 && strings.Contains(b.Name(), "/postgres/") {
		b.ReportMetric(float64(pg.Microseconds())/float64(b.N), "pg-cpu-us/op")
	}
}

func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postgresCPU sums the CPU time (utime+stime, and the postmaster's
// cutime+cstime: backends that exited) of every process named postgres
// on this machine, 0 when there are none or /proc cannot be read. It
// measures the server's side of a PostgreSQL benchmark when the test
// database is local and nothing else uses it meanwhile.
func postgresCPU() time.Duration {
	dirs, _ := os.ReadDir("/proc")
	var ticks int64
	for _, d := range dirs {
		if d.Name()[0] < '0' || d.Name()[0] > '9' {
			continue
		}
		raw, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		open, end := bytes.IndexByte(raw, '('), bytes.LastIndexByte(raw, ')')
		if open < 0 || end < open || string(raw[open+1:end]) != "postgres" {
			continue
		}
		f := strings.Fields(string(raw[end+1:]))
		// After the name: state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14).
		if len(f) < 15 {
			continue
		}
		for _, i := range []int{11, 12, 13, 14} {
			v, _ := strconv.ParseInt(f[i], 10, 64)
			ticks += v
		}
	}
	return time.Duration(ticks) * (time.Second / 100) // USER_HZ
}

// tpmBench splits a TPM benchmark's time between the TPM (bcd's side:
// tpmkeys against swtpm) and the server (JoinService in-process).
type tpmBench struct{ tpm, server time.Duration }

// timed runs f, adding its time to *d.
func timed(b *testing.B, d *time.Duration, f func() error) {
	b.Helper()
	t0 := time.Now()
	if err := f(); err != nil {
		b.Fatal(err)
	}
	*d += time.Since(t0)
}

func (m *tpmBench) report(b *testing.B, unit string) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), unit)
	b.ReportMetric(float64(m.tpm.Microseconds())/1000/float64(b.N), "tpm-ms/op")
	b.ReportMetric(float64(m.server.Microseconds())/1000/float64(b.N), "server-ms/op")
}

// BenchmarkTPM runs token-less tpm joins (R9.2) and attested renewals
// (R13.3) against a real swtpm, serially (one TPM serves one command at a
// time), on each store. bcd's side is tpmkeys exactly as `bcd join
// --attestor tpm` and the renewal use it: a node key made in the TPM, the
// CSR signed by it, the AK's certify, the EK, and the credential
// activation; the server's side is JoinService's two legs, or Renew.
func BenchmarkTPM(b *testing.B) {
	tpmtest.Require(b)
	eachStore(b, func(b *testing.B, e *apitest.Env, f *fixture) {
		env := newTPMEnv(b, f, f.trustCAs(b))
		keys := &tpmkeys.Keys{TPM: env.tp}
		ctx := context.Background()
		peer := join.Peer{Addr: "192.0.2.9:1"}
		// join makes one tpm join; it returns the node, its key and
		// its certificate chain.
		join1 := func(b *testing.B, m *tpmBench) (string, crypto.Signer, [][]byte) {
			var signer crypto.Signer
			var csr, att, ev []byte
			var kind tpmdevice.EKKind
			timed(b, &m.tpm, func() (err error) {
				if signer, _, err = keys.GenerateKey(); err != nil {
					return err
				}
				if csr, err = identity.NewCSR(signer, ""); err != nil {
					return err
				}
				if att, _, err = keys.AttestKey(signer, csr); err != nil {
					return err
				}
				ev, kind, err = keys.Evidence()
				return err
			})
			req := &agentv1.JoinRequest{Csr: csr, Claims: jointest.Claims(int(machineSeq.Add(1))), Attestor: tpm.Name, Protocol: 1, Evidence: ev, KeyAttestation: att}
			var res *agentv1.JoinResponse
			timed(b, &m.server, func() (err error) { res, err = env.svc.Join(ctx, req, peer); return })
			timed(b, &m.tpm, func() (err error) { req.ChallengeResponse, err = keys.Answer(kind, res.GetChallenge()); return })
			timed(b, &m.server, func() (err error) { res, err = env.svc.Join(ctx, req, peer); return })
			var body agentv1.JoinResponseBody
			if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
				b.Fatal(err)
			}
			return body.GetNodeId(), signer, body.GetCertChain()
		}
		b.Run("join", func(b *testing.B) {
			var m tpmBench
			for i := 0; i < b.N; i++ {
				join1(b, &m)
			}
			m.report(b, "joins/s")
		})
		b.Run("renew", func(b *testing.B) {
			nodeID, key, chain := join1(b, &tpmBench{})
			var m tpmBench
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				var next crypto.Signer
				var csr, att, pop []byte
				ms := env.clk.Now().UnixMilli()
				timed(b, &m.tpm, func() (err error) {
					if next, _, err = keys.GenerateKey(); err != nil {
						return err
					}
					if csr, err = identity.NewCSR(next, nodeID); err != nil {
						return err
					}
					if att, _, err = keys.AttestKey(next, csr); err != nil {
						return err
					}
					pop, err = pki.SignRenewPoP(key, csr, nodeID, ms)
					return err
				})
				req := &agentv1.RenewRequest{Csr: csr, Chain: chain, ClientTimeUnixMs: ms, PopSig: pop, NodeId: nodeID, KeyAttestation: att}
				var res *agentv1.RenewResponse
				timed(b, &m.server, func() (err error) {
					res, err = env.svc.Renew(ctx, req, join.Peer{Addr: peer.Addr, Cert: chain[0]})
					return
				})
				var body agentv1.JoinResponseBody
				if err := proto.Unmarshal(res.GetBody(), &body); err != nil {
					b.Fatal(err)
				}
				key, chain = next, body.GetCertChain()
			}
			m.report(b, "renewals/s")
		})
	})
}

// BenchmarkJoinMetrics is BenchmarkJoin's serial join on SQLite with the
// fleet metrics off (no api.Config.Metrics) and on, in one run, so their
// CPU per join can be compared (docs/contributors/performance.md, "Fleet
// metrics").
func BenchmarkJoinMetrics(b *testing.B) {
	for _, m := range []struct {
		name    string
		metrics func() *apimetrics.API
	}{{"off", func() *apimetrics.API { return nil }}, {"on", func() *apimetrics.API { return apimetrics.NewAPI(prometheus.NewRegistry()) }}} {
		b.Run(m.name, func(b *testing.B) {
			e := apitest.Start(b, storetest.OpenSQLite(b), apitest.Options{Metrics: m.metrics()})
			f := newFixture(b, e)
			tok := f.token(b, &bcv1.CreateJoinTokenRequest{MaxUses: 100000})
			reqs := make([]*agentv1.JoinRequest, b.N)
			for i := range reqs {
				reqs[i] = jointest.NewMachine(b, jointest.Claims(int(machineSeq.Add(1)))).Request(b, e.Bundle, tok.Token, "")
			}
			ctx := context.Background()
			cpu := startCPU(b)
			for i := 0; i < b.N; i++ {
				if _, err := f.svc.Join(ctx, reqs[i], join.Peer{}); err != nil {
					b.Fatal(err)
				}
			}
			cpu.report(b)
		})
	}
}
