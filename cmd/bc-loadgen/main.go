// Command bc-loadgen joins many simulated machines through a gateway, and
// with --mode renew then renews each of them; see internal/tools/loadgen and
// docs/contributors/performance.md.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime/debug"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/better-compute/better-compute/internal/tools/loadgen"
)

// leanGCPercent is a lean holder's GOGC unless the environment sets one.
const leanGCPercent = 20

func main() {
	var cfg loadgen.Config
	var tokenFile, pids string
	var asJSON bool
	var otlpSink string
	var hold loadgen.HoldOptions
	var plan string
	var fleet loadgen.FleetOptions
	flag.StringVar(&cfg.BCDConfig, "bcd-config", "", "a bcd config.toml (gateway, site, pins; join-encryption.jwk beside it)")
	flag.StringVar(&tokenFile, "token-file", "", "file holding a join token with enough uses")
	flag.IntVar(&cfg.Machines, "machines", 1000, "machines to join")
	flag.IntVar(&cfg.Concurrency, "concurrency", 32, "joins in flight")
	flag.BoolVar(&cfg.NewConnections, "new-connections", false, "a new TLS connection per join or renewal (as real machines do)")
	flag.StringVar(&cfg.Mode, "mode", "join", "join; renew: join the machines (reused connections), then renew each of them; hold: join them, then run bcd's session and renewer for each until interrupted; fleet: conduct scripts/bench-fleet's --plan")
	flag.IntVar(&cfg.Renewals, "renewals", 1, "renew mode: renewals per machine, one after the other (without --new-connections over the machine's own connection)")
	flag.BoolVar(&cfg.Resume, "resume", false, "renew mode: a TLS session cache per machine and identity, as bcd keeps; each machine gets a ticket before the clock starts, so its first renewal resumes")
	flag.StringVar(&pids, "pids", "", "processes to account CPU for, e.g. api=1234,gateway=1235; api=1234+1240 sums two API replicas")
	flag.BoolVar(&cfg.Verify, "verify", true, "check every answer as bcd does, after the timed phase")
	flag.BoolVar(&cfg.MeasureFloor, "floor", true, "measure the crypto floor after the run and print the API's CPU as a multiple of it")
	flag.StringVar(&cfg.Seed, "seed", "", "makes hardware claims distinct across runs (default: the time)")
	flag.BoolVar(&asJSON, "json", false, "print the result as JSON")
	flag.StringVar(&otlpSink, "otlp-sink", "", "only serve a discarding OTLP/HTTP trace receiver on this address until interrupted, then print the spans received")
	flag.StringVar(&hold.DataDir, "data-dir", "", "hold mode: a directory for the machines' identities")
	flag.StringVar(&hold.Status, "status", "", "hold mode: serve the status (JSON) on this address")
	flag.DurationVar(&hold.IdentityCheck, "identity-check", 30*time.Second, "hold mode: how often each daemon re-reads its identity (bcd's default 30s)")
	flag.Float64Var(&hold.StartRate, "start-rate", 0, "hold mode: daemons started per second (0: all at once)")
	flag.BoolVar(&hold.Lean, "lean", false, "hold mode: lean daemons (bcd's protocol over real TLS, one connection, timers and callbacks each: a fraction of the memory) instead of bcd's own loop")
	flag.StringVar(&plan, "plan", "", "fleet mode: the plan scripts/bench-fleet wrote")
	flag.DurationVar(&fleet.Duration, "duration", 2*time.Minute, "fleet mode: the steady window")
	flag.DurationVar(&fleet.Timeout, "timeout", 10*time.Minute, "fleet mode: the longest wait of each phase")
	flag.Parse()
	if otlpSink != "" {
		if err := serveOTLPSink(otlpSink); err != nil {
			fmt.Fprintf(os.Stderr, "Error: %v\n", err)
			os.Exit(1)
		}
		return
	}
	var err error
	switch cfg.Mode {
	case "hold":
		if hold.Lean && os.Getenv("GOGC") == "" {
			// Nearly all of a lean holder's heap is its daemons, alive
			// for the whole run: collecting at 20% growth instead of
			// 100% keeps the RSS near what they hold, for a little CPU.
			debug.SetGCPercent(leanGCPercent)
		}
		err = runHold(cfg, tokenFile, hold)
	case "fleet":
		err = runFleet(plan, fleet, asJSON)
	default:
		err = run(cfg, tokenFile, pids, asJSON)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "Error: %v\n", err)
		os.Exit(1)
	}
}

func run(cfg loadgen.Config, tokenFile, pids string, asJSON bool) error {
	if cfg.BCDConfig == "" || tokenFile == "" {
		return fmt.Errorf("--bcd-config and --token-file are required")
	}
	b, err := os.ReadFile(tokenFile)
	if err != nil {
		return err
	}
	cfg.Token = strings.TrimSpace(string(b))
	if pids != "" {
		if cfg.PIDs, err = loadgen.ParsePIDs(pids); err != nil {
			return err
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt)
	defer cancel()
	r, err := loadgen.Run(ctx, cfg, func(s string) { fmt.Fprintln(os.Stderr, s) })
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	mode := "reused connections"
	if r.NewConnections {
		mode = "new TLS connection per join"
	}
	what := ""
	if r.Renew != nil {
		what = " (setting up the renewals)"
	}
	fmt.Printf("%d machines, concurrency %d, %s%s\n", r.Machines, r.Concurrency, mode, what)
	fmt.Printf("joined %d, refused %d, failed %d in %.2fs: %.0f joins/s\n", r.Joined, r.Refused, r.Failed, r.Seconds, r.JoinsPerSecond)
	fmt.Printf("latency p50 %.1f ms, p90 %.1f ms, p99 %.1f ms, max %.1f ms\n", r.P50ms, r.P90ms, r.P99ms, r.MaxMs)
	printCPU("join", r.CPUmsPerJoin)
	printErrors(r.Errors)
	if r.Verified > 0 {
		fmt.Printf("verified %d answers as bcd does\n", r.Verified)
	}
	if rr := r.Renew; rr != nil {
		mode := "each machine over its own connection"
		if rr.NewConnections {
			mode = "new TLS connection per renewal"
		}
		if rr.Resume {
			mode += fmt.Sprintf(", TLS sessions resumed (%d connections resumed)", rr.Resumed)
		}
		fmt.Printf("renewals: %d machines x %d, concurrency %d, %s\n", rr.Machines, rr.RenewalsPerMachine, rr.Concurrency, mode)
		fmt.Printf("renewed %d, refused %d, failed %d, skipped %d in %.2fs: %.0f renewals/s\n", rr.Renewed, rr.Refused, rr.Failed, rr.Skipped, rr.Seconds, rr.RenewalsPerSecond)
		fmt.Printf("latency p50 %.1f ms, p90 %.1f ms, p99 %.1f ms, max %.1f ms\n", rr.P50ms, rr.P90ms, rr.P99ms, rr.MaxMs)
		printCPU("renewal", rr.CPUmsPerRenewal)
		printErrors(rr.Errors)
		if rr.Verified > 0 {
			fmt.Printf("verified %d renewal answers as bcd does\n", rr.Verified)
		}
	}
	fmt.Println(r.Summary())
	return nil
}

// runHold holds the machines until SIGINT or SIGTERM.
func runHold(cfg loadgen.Config, tokenFile string, opts loadgen.HoldOptions) error {
	if cfg.BCDConfig == "" || tokenFile == "" {
		return fmt.Errorf("--bcd-config and --token-file are required")
	}
	b, err := os.ReadFile(tokenFile)
	if err != nil {
		return err
	}
	cfg.Token = strings.TrimSpace(string(b))
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	return loadgen.Hold(ctx, cfg, opts, func(s string) { fmt.Fprintln(os.Stderr, s) })
}

// runFleet conducts a fleet run and prints its report.
func runFleet(path string, opts loadgen.FleetOptions, asJSON bool) error {
	if path == "" {
		return fmt.Errorf("--plan is required")
	}
	plan, err := loadgen.LoadFleetPlan(path)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	r, err := loadgen.Conduct(ctx, plan, opts, func(s string) { fmt.Fprintf(os.Stderr, "%s %s\n", time.Now().Format("15:04:05"), s) })
	if r != nil {
		if asJSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			if jerr := enc.Encode(r); jerr != nil && err == nil {
				err = jerr
			}
		} else {
			fmt.Print(r.Text())
		}
	}
	return err
}

// serveOTLPSink serves a loadgen.OTLPSink on addr until SIGINT or
// SIGTERM, then prints what it received.
func serveOTLPSink(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	var sink loadgen.OTLPSink
	fmt.Fprintf(os.Stderr, "OTLP sink listening on %s\n", ln.Addr())
	err = sink.Serve(ctx, ln)
	fmt.Printf("otlp sink: %d spans in %d export requests, %d rejected\n", sink.Spans(), sink.Requests(), sink.Rejected())
	return err
}

func printCPU(what string, cpu map[string]float64) {
	names := make([]string, 0, len(cpu))
	for name := range cpu {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Printf("CPU per %s, %s: %.3f ms\n", what, name, cpu[name])
	}
}

func printErrors(m map[string]int) {
	for e, n := range m {
		fmt.Printf("error x%d: %s\n", n, e)
	}
}
