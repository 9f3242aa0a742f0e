// Package loadgen joins many simulated machines through a real gateway with
// the real protocol, to measure how fast a control plane admits a rack (or a
// region after an outage). Every machine has its own P-256 key, CSR,
// distinct hardware claims and a token sealed to its CSR; all of that is made
// before the clock starts, so the measured phase spends the generator's CPU
// only on TLS and RPC. It reports joins/s, latency percentiles and, given the
// API's and the gateway's process ids, their CPU seconds per join read from
// /proc.
//
// In renew mode (Config.Mode "renew") it first joins the machines (over
// reused connections, reported apart), then renews every one of them
// through the gateway with the real protocol (R13): a new key and CSR per
// renewal made before the clock starts, the renew-pop proof signed right
// before sending (it needs the client time), the machine's current
// certificate as TLS client certificate. See renew.go.
package loadgen

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/version"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// Config describes one run.
type Config struct {
	// BCDConfig is a bcd config.toml (gateway, site, pins); the
	// join-encryption.jwk beside it seals the tokens.
	BCDConfig string
	// Token must have at least Machines uses left.
	Token       string
	Machines    int
	Concurrency int
	// NewConnections opens a new TLS connection for every join, as real
	// machines do; otherwise each worker reuses one connection.
	NewConnections bool
	// PIDs names processes whose CPU is accounted per join, e.g.
	// {"api": {1234}, "gateway": {1235}}; a name with several processes
	// (API replicas) gets their sum.
	PIDs map[string][]int
	// Verify checks every answer as bcd does (after the timed phase).
	Verify bool
	// Seed makes claims distinct across runs against one database.
	Seed string
	// Mode is "join" (the default) or "renew": join the machines, then
	// renew each of them Renewals times (renew.go).
	Mode string
	// Renewals is how many times each machine renews in renew mode (default
	// 1). Without NewConnections a machine's renewals share that machine's
	// own connection; connections are never shared across machines, whose
	// client certificates differ.
	Renewals int
	// Resume, in renew mode, keeps a TLS session cache per machine and
	// identity, as bcd does: before the clock starts each machine makes one
	// call with its current certificate (as its session would have), so
	// its first renewal resumes that TLS session instead of a full
	// handshake. A renewed machine starts a new cache (its new
	// certificate needs a full handshake).
	Resume bool
	// MeasureFloor measures the crypto floor after the run (Result.Floor,
	// about two seconds of CPU).
	MeasureFloor bool
}

// Result is what a run measured.
type Result struct {
	Machines       int                `json:"machines"`
	Concurrency    int                `json:"concurrency"`
	NewConnections bool               `json:"newConnections"`
	Joined         int                `json:"joined"`
	Refused        int                `json:"refused"`
	Failed         int                `json:"failed"`
	Errors         map[string]int     `json:"errors,omitempty"`
	Seconds        float64            `json:"seconds"`
	JoinsPerSecond float64            `json:"joinsPerSecond"`
	P50ms          float64            `json:"p50Ms"`
	P90ms          float64            `json:"p90Ms"`
	P99ms          float64            `json:"p99Ms"`
	MaxMs          float64            `json:"maxMs"`
	CPUmsPerJoin   map[string]float64 `json:"cpuMsPerJoin,omitempty"`
	Verified       int                `json:"verified"`
	// Renew is the renewal phase of a renew-mode run; the fields above
	// describe its join phase.
	Renew *RenewResult `json:"renew,omitempty"`
	// Floor is the crypto floor measured right after the run.
	Floor *Floor `json:"floor,omitempty"`
}

type machine struct {
	key     *ecdsa.PrivateKey
	csr     []byte
	req     *agentv1.JoinRequest
	res     *agentv1.JoinResponse
	body    *agentv1.JoinResponseBody // the verified answer
	latency time.Duration
	err     error
}

// target is what both modes need from the bcd config.
type target struct {
	bc      *bcdconfig.Config
	encKey  *ecdsa.PublicKey
	tlsConf *tls.Config
}

// Run performs one run.
func Run(ctx context.Context, cfg Config, progress func(string)) (*Result, error) {
	if progress == nil {
		progress = func(string) {}
	}
	if cfg.Machines <= 0 || cfg.Concurrency <= 0 {
		return nil, errs.New(errs.InvalidArgument, "machines and concurrency must be positive")
	}
	switch cfg.Mode {
	case "", "join":
	case "renew":
		if cfg.Renewals == 0 {
			cfg.Renewals = 1
		}
		if cfg.Renewals < 0 {
			return nil, errs.New(errs.InvalidArgument, "renewals must be positive")
		}
	default:
		return nil, errs.New(errs.InvalidArgument, "mode must be join or renew, not %q", cfg.Mode)
	}
	tg, err := loadTarget(cfg.BCDConfig)
	if err != nil {
		return nil, err
	}
	if cfg.Mode != "renew" {
		r, _, err := runJoin(ctx, cfg, tg, progress)
		if err == nil && cfg.MeasureFloor {
			err = measureFloor(r, progress)
		}
		return r, err
	}
	// The join phase only sets the machines up: reused connections, every
	// answer verified (the renewals need the certificates).
	jcfg := cfg
	jcfg.NewConnections, jcfg.Verify = false, true
	r, ms, err := runJoin(ctx, jcfg, tg, progress)
	if err != nil {
		return r, err
	}
	rr, err := runRenew(ctx, cfg, tg, ms, progress)
	r.Renew = rr
	if err == nil && cfg.MeasureFloor {
		err = measureFloor(r, progress)
	}
	return r, err
}

// measureFloor measures the crypto floor after the run, under the same
// load, into r.
func measureFloor(r *Result, progress func(string)) error {
	progress("measuring the crypto floor…")
	f, err := MeasureFloor()
	if err != nil {
		return fmt.Errorf("crypto floor: %w", err)
	}
	r.Floor = &f
	return nil
}

func loadTarget(path string) (*target, error) {
	bc, err := bcdconfig.Load(path)
	if err != nil {
		return nil, err
	}
	encKey, _, found, err := bcdconfig.LoadEncryptionKeySet(filepath.Dir(path), bc.JoinEncryptionPins())
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, errs.New(errs.InvalidConfig, "no %s beside %s", bcdconfig.EncryptionKeyFile, path)
	}
	u, err := url.Parse(bc.GatewayURL)
	if err != nil {
		return nil, err
	}
	serverName := bc.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	tlsConf, err := enroll.PinnedTLSConfig(bc.ServingCAPins(), serverName, time.Now)
	if err != nil {
		return nil, err
	}
	return &target{bc: bc, encKey: encKey, tlsConf: tlsConf}, nil
}

// runJoin joins cfg.Machines machines and returns them with their answers.
func runJoin(ctx context.Context, cfg Config, tg *target, progress func(string)) (*Result, []*machine, error) {
	bc, encKey, tlsConf := tg.bc, tg.encKey, tg.tlsConf
	progress(fmt.Sprintf("preparing %d machines (keys, CSRs, claims, sealed tokens)…", cfg.Machines))
	seed := cfg.Seed
	if seed == "" {
		seed = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	ms := make([]*machine, cfg.Machines)
	for i := range ms {
		m, err := prepare(i, seed, cfg.Token, encKey)
		if err != nil {
			return nil, nil, err
		}
		ms[i] = m
	}

	newClient := func() agentv1connect.JoinServiceClient {
		tr := &http.Transport{TLSClientConfig: tlsConf.Clone(), ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 1,
			DisableKeepAlives: cfg.NewConnections, TLSHandshakeTimeout: 30 * time.Second}
		// A fresh session cache per client: no TLS resumption across
		// machines, as real machines have none.
		tr.TLSClientConfig.ClientSessionCache = nil
		return agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr, Timeout: 60 * time.Second}, bc.GatewayURL, connect.WithGRPC())
	}

	before := cpuTimes(cfg.PIDs)
	progress(fmt.Sprintf("joining %d machines, %d at a time, %s…", cfg.Machines, cfg.Concurrency, map[bool]string{true: "a new TLS connection per join", false: "reusing connections"}[cfg.NewConnections]))
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < cfg.Concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := newClient()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(ms) || ctx.Err() != nil {
					return
				}
				m := ms[i]
				if cfg.NewConnections {
					client = newClient()
				}
				t0 := time.Now()
				res, err := client.Join(ctx, connect.NewRequest(m.req))
				m.latency = time.Since(t0)
				m.req = nil // sent: not kept for the hours a holder holds
				if err != nil {
					m.err = wire.FromWire(err)
					continue
				}
				m.res = res.Msg
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	after := cpuTimes(cfg.PIDs)

	r := &Result{Machines: cfg.Machines, Concurrency: cfg.Concurrency, NewConnections: cfg.NewConnections, Seconds: elapsed.Seconds(), Errors: map[string]int{}}
	var lat []time.Duration
	for _, m := range ms {
		switch {
		case m.err == nil && m.res != nil:
			r.Joined++
			lat = append(lat, m.latency)
		case errs.Is(m.err, errs.AccessDenied):
			r.Refused++
		default:
			r.Failed++
			if m.err != nil {
				r.Errors[m.err.Error()]++
			}
		}
	}
	r.JoinsPerSecond = float64(r.Joined) / elapsed.Seconds()
	st := statsOf(lat)
	r.P50ms, r.P90ms, r.P99ms, r.MaxMs = st.p50, st.p90, st.p99, st.max
	r.CPUmsPerJoin = cpuPer(before, after, r.Joined)
	if cfg.Verify {
		progress("checking every answer as bcd does…")
		for i, m := range ms {
			if m.res == nil {
				continue
			}
			sum := sha256.Sum256(m.csr)
			body, err := enroll.VerifyResponse(m.res, enroll.Expectation{SigningPins: bc.JoinSigningPins(), CSRHash: sum[:], NodeKey: m.key.Public(), SiteID: bc.Site, Role: pki.RoleNode})
			if err != nil {
				return r, ms, fmt.Errorf("answer for machine %d: %w", i, err)
			}
			m.body = body
			m.res, m.csr = nil, nil // checked: the body is what is used
			r.Verified++
		}
	}
	return r, ms, nil
}

type latencyStats struct{ p50, p90, p99, max float64 }

// statsOf sorts lat and returns its percentiles in milliseconds.
func statsOf(lat []time.Duration) latencyStats {
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	st := latencyStats{p50: pct(0.50), p90: pct(0.90), p99: pct(0.99)}
	if len(lat) > 0 {
		st.max = float64(lat[len(lat)-1].Microseconds()) / 1000
	}
	return st
}

// cpuPer is the CPU milliseconds each process spent per operation between
// two cpuTimes readings.
func cpuPer(before, after map[string]float64, ops int) map[string]float64 {
	if len(after) == 0 || ops == 0 {
		return nil
	}
	out := map[string]float64{}
	for name, a := range after {
		if b, ok := before[name]; ok {
			out[name] = (a - b) * 1000 / float64(ops)
		}
	}
	return out
}

// ParsePIDs reads --pids: name=pid pairs separated by commas, where pid may
// be several pids joined by + whose CPU is summed ("api=11+12,gateway=13":
// two API replicas and a gateway).
func ParsePIDs(s string) (map[string][]int, error) {
	out := map[string][]int{}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--pids: want name=pid[+pid...], got %q", kv)
		}
		if _, dup := out[k]; dup {
			return nil, fmt.Errorf("--pids: %q is named twice; join its pids with +", k)
		}
		for _, p := range strings.Split(v, "+") {
			n, err := strconv.Atoi(p)
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("--pids: want name=pid[+pid...], got %q", kv)
			}
			out[k] = append(out[k], n)
		}
	}
	return out, nil
}

func prepare(i int, seed, token string, encKey *ecdsa.PublicKey) (*machine, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	csr, err := identity.NewCSR(key, "loadgen")
	if err != nil {
		return nil, err
	}
	h := sha256.Sum256([]byte(seed + "/" + strconv.Itoa(i)))
	mac := fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", h[0]&0xfc, h[1], h[2], h[3], h[4], h[5])
	uuid := fmt.Sprintf("%x-%x-%x-%x-%x", h[6:10], h[10:12], h[12:14], h[14:16], h[16:22])
	req := &agentv1.JoinRequest{
		Csr: csr, Protocol: version.ProtocolMax,
		Claims: &agentv1.Claims{ProductUuid: uuid, ProductSerial: fmt.Sprintf("LG-%s-%06d", seed, i), Macs: []string{mac}, Hostname: fmt.Sprintf("lg-%06d", i)},
	}
	// As bcd does: the seal covers the complete request (R4.2).
	sealed, err := pki.Seal(encKey, token, csr, pki.JoinRequestDigest(req), time.Now())
	if err != nil {
		return nil, err
	}
	req.SealedToken = sealed
	return &machine{key: key, csr: csr, req: req}, nil
}

// cpuTimes reads utime+stime (seconds) of each named set of processes from
// /proc, summed over the set. A name whose processes cannot all be read is
// left out, so a process that died mid-run gives no figure rather than a
// wrong one.
func cpuTimes(pids map[string][]int) map[string]float64 {
	out := map[string]float64{}
	for name, set := range pids {
		var sum float64
		ok := len(set) > 0
		for _, pid := range set {
			t, err := cpuTime(pid)
			if err != nil {
				ok = false
				break
			}
			sum += t
		}
		if ok {
			out[name] = sum
		}
	}
	return out
}

// cpuTime is one process's utime+stime in seconds.
func cpuTime(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which may contain spaces.
	s := string(b)
	rest := s[strings.LastIndexByte(s, ')')+2:]
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / clockTicks, nil
}

// clockTicks is USER_HZ, 100 on Linux.
const clockTicks = 100
