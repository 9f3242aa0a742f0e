// Package loadgen joins many simulated machines through a real gateway with
// the real protocol, to measure how fast a control plane admits a rack (or a
// region after an outage). Every machine has its own P-256 key, CSR,
// distinct hardware claims and a token sealed to its CSR; all of that is made
// before the clock starts, so the measured phase spends the generator's CPU
// only on TLS and RPC. It reports joins/s, latency percentiles and, given the
// API's and the gateway's process ids, their CPU seconds per join read from
// /proc.
package loadgen

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
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
	bcdconfig "github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	bcdjoin "github.com/better-compute/better-compute/internal/bcd/join"
	"github.com/better-compute/better-compute/internal/errs"
	"github.com/better-compute/better-compute/internal/pki"
	"github.com/better-compute/better-compute/internal/version"
	"github.com/better-compute/better-compute/internal/wire"
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
	// {"api": 1234, "gateway": 1235}.
	PIDs map[string]int
	// Verify checks every answer as bcd does (after the timed phase).
	Verify bool
	// Seed makes claims distinct across runs against one database.
	Seed string
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
}

type machine struct {
	key     *ecdsa.PrivateKey
	csr     []byte
	req     *agentv1.JoinRequest
	res     *agentv1.JoinResponse
	latency time.Duration
	err     error
}

// Run performs one run.
func Run(ctx context.Context, cfg Config, progress func(string)) (*Result, error) {
	if progress == nil {
		progress = func(string) {}
	}
	if cfg.Machines <= 0 || cfg.Concurrency <= 0 {
		return nil, errs.New(errs.InvalidArgument, "machines and concurrency must be positive")
	}
	bc, err := bcdconfig.Load(cfg.BCDConfig)
	if err != nil {
		return nil, err
	}
	encKey, found, err := bcdconfig.LoadEncryptionKey(filepath.Dir(cfg.BCDConfig), bc.JoinEncryptionKeyPin)
	if err != nil {
		return nil, err
	}
	if !found {
		return nil, errs.New(errs.InvalidConfig, "no %s beside %s", bcdconfig.EncryptionKeyFile, cfg.BCDConfig)
	}
	u, err := url.Parse(bc.GatewayURL)
	if err != nil {
		return nil, err
	}
	serverName := bc.GatewayServerName
	if serverName == "" {
		serverName = u.Hostname()
	}
	tlsConf, err := bcdjoin.PinnedTLSConfig(bc.ServingCASPKIPin, serverName, time.Now)
	if err != nil {
		return nil, err
	}

	progress(fmt.Sprintf("preparing %d machines (keys, CSRs, claims, sealed tokens)…", cfg.Machines))
	seed := cfg.Seed
	if seed == "" {
		seed = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	ms := make([]*machine, cfg.Machines)
	for i := range ms {
		m, err := prepare(i, seed, cfg.Token, encKey)
		if err != nil {
			return nil, err
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
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Microseconds()) / 1000
	}
	r.P50ms, r.P90ms, r.P99ms = pct(0.50), pct(0.90), pct(0.99)
	if len(lat) > 0 {
		r.MaxMs = float64(lat[len(lat)-1].Microseconds()) / 1000
	}
	if len(cfg.PIDs) > 0 && r.Joined > 0 {
		r.CPUmsPerJoin = map[string]float64{}
		for name := range cfg.PIDs {
			r.CPUmsPerJoin[name] = (after[name] - before[name]) * 1000 / float64(r.Joined)
		}
	}
	if cfg.Verify {
		progress("checking every answer as bcd does…")
		for _, m := range ms {
			if m.res == nil {
				continue
			}
			sum := sha256.Sum256(m.csr)
			if _, err := bcdjoin.VerifyResponse(m.res, bcdjoin.Expectation{SigningPin: bc.JoinSigningKeyPin, CSRHash: sum[:], NodeKey: m.key.Public(), SiteID: bc.Site, Role: pki.RoleNode}); err != nil {
				return r, fmt.Errorf("answer for machine %d: %w", slices.Index(ms, m), err)
			}
			r.Verified++
		}
	}
	return r, nil
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
	sealed, err := pki.Seal(encKey, token, csr, time.Now())
	if err != nil {
		return nil, err
	}
	h := sha256.Sum256([]byte(seed + "/" + strconv.Itoa(i)))
	mac := fmt.Sprintf("%02x:%02x:%02x:%02x:%02x:%02x", h[0]&0xfc, h[1], h[2], h[3], h[4], h[5])
	uuid := fmt.Sprintf("%x-%x-%x-%x-%x", h[6:10], h[10:12], h[12:14], h[14:16], h[16:22])
	return &machine{key: key, csr: csr, req: &agentv1.JoinRequest{
		SealedToken: sealed, Csr: csr, Protocol: version.ProtocolMax,
		Claims: &agentv1.Claims{ProductUuid: uuid, ProductSerial: fmt.Sprintf("LG-%s-%06d", seed, i), Macs: []string{mac}, Hostname: fmt.Sprintf("lg-%06d", i)},
	}}, nil
}

// cpuTimes reads utime+stime (seconds) of each process from /proc.
func cpuTimes(pids map[string]int) map[string]float64 {
	out := map[string]float64{}
	for name, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command name, which may contain spaces.
		s := string(b)
		rest := s[strings.LastIndexByte(s, ')')+2:]
		f := strings.Fields(rest)
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseFloat(f[11], 64)
		st, _ := strconv.ParseFloat(f[12], 64)
		out[name] = (ut + st) / clockTicks
	}
	return out
}

// clockTicks is USER_HZ, 100 on Linux.
const clockTicks = 100
