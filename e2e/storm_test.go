package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// stormConfig describes a join storm: machines (prepareMachine) joining
// through a gateway URL the way bcd does.
type stormConfig struct {
	URL         string      // the gateway (or the balancer in front of gateways)
	TLS         *tls.Config // pinned to the serving CA, as bcd's
	SigningPin  string      // join_signing_key_pin: every answer is verified
	Site        string
	Machines    []*stormMachine
	Concurrency int
	// Every, when set, paces the storm: a machine starts at most every
	// Every, so the storm lasts at least len(Machines) x Every and a kill
	// lands in the middle of it whatever the machine's speed.
	Every time.Duration
	// OnlyRetryable, when set, resends a request only after an answer
	// that says it may be retried (UNAVAILABLE, or no answer at all); any
	// other error is final for that machine and fails the test.
	OnlyRetryable bool
}

// stormRun is a running storm.
type stormRun struct {
	confirmed atomic.Int64
	wg        sync.WaitGroup

	mu       sync.Mutex
	failures []time.Time       // when an attempt got no answer (retried)
	codes    map[errs.Code]int // the errors seen, by product code
}

// startStorm starts the storm: every machine tries until it is told yes
// or no, resending the same request after anything else (a replica or
// gateway died, a timeout, an unknown outcome), as bcd does (R4.9). Each
// worker keeps one connection and dials again after it broke.
func startStorm(ctx context.Context, t *testing.T, cfg stormConfig) *stormRun {
	r := &stormRun{codes: map[errs.Code]int{}}
	feed := make(chan *stormMachine)
	go func() {
		defer close(feed)
		var tick <-chan time.Time
		if cfg.Every > 0 {
			tk := time.NewTicker(cfg.Every)
			defer tk.Stop()
			tick = tk.C
		}
		for _, m := range cfg.Machines {
			if tick != nil {
				select {
				case <-tick:
				case <-ctx.Done():
					return
				}
			}
			select {
			case feed <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	for range cfg.Concurrency {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			tr := &http.Transport{TLSClientConfig: cfg.TLS.Clone(), ForceAttemptHTTP2: true, MaxIdleConnsPerHost: 1}
			defer tr.CloseIdleConnections()
			client := agentv1connect.NewJoinServiceClient(&http.Client{Transport: tr, Timeout: 20 * time.Second}, cfg.URL, connect.WithGRPC())
			for m := range feed {
				for ctx.Err() == nil {
					res, err := client.Join(ctx, connect.NewRequest(m.req))
					if err == nil {
						sum := sha256.Sum256(m.csr)
						body, verr := enroll.VerifyResponse(res.Msg, enroll.Expectation{SigningPin: cfg.SigningPin, CSRHash: sum[:], NodeKey: m.key.Public(), SiteID: cfg.Site, Role: pki.RoleNode})
						if verr != nil {
							t.Errorf("machine %s: answer fails bcd's checks: %v", m.host, verr)
							break
						}
						m.nodeID = body.GetNodeId()
						r.confirmed.Add(1)
						break
					}
					internal := connect.CodeOf(err) == connect.CodeInternal
					err = wire.FromWire(err)
					code := errs.CodeOf(err)
					if internal {
						code = errs.Internal
					}
					m.errAt = append(m.errAt, time.Now())
					r.mu.Lock()
					r.codes[code]++
					r.mu.Unlock()
					if cfg.OnlyRetryable && code != errs.Unavailable && code != errs.AccessDenied {
						t.Errorf("machine %s: %s: not retryable", m.host, err)
						m.lastErr = err.Error()
						break
					}
					if errs.Is(err, errs.AccessDenied) {
						m.refused = true
						break
					}
					if ctx.Err() != nil {
						break
					}
					r.mu.Lock()
					r.failures = append(r.failures, time.Now())
					r.mu.Unlock()
					m.ambiguous, m.lastErr = true, err.Error()
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	return r
}

// errorCodes returns how many errors of each product code the storm saw.
func (r *stormRun) errorCodes() map[errs.Code]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[errs.Code]int{}
	for c, n := range r.codes {
		out[c] = n
	}
	return out
}

// wait waits for every worker to finish.
func (r *stormRun) wait() { r.wg.Wait() }

// failed returns when attempts went unanswered.
func (r *stormRun) failed() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Time(nil), r.failures...)
}

// stormCounts counts the machines refused and those that saw an answer
// that was neither yes nor no.
func stormCounts(ms []*stormMachine) (refused, ambiguous int) {
	for _, m := range ms {
		if m.refused {
			refused++
		}
		if m.ambiguous {
			ambiguous++
		}
	}
	return refused, ambiguous
}

// stormBCD is the bcd side of a storm: a bcd config in dir/bcd for
// gatewayURL (the join encryption key from dir/pki beside it, as an
// install writes it), loaded, with the key tokens are sealed to and the
// TLS config pinned to the serving CA.
type stormBCD struct {
	Conf   string // dir/bcd/config.toml
	Config *bcdconfig.Config
	EncKey *ecdsa.PublicKey
	TLS    *tls.Config
}

func newStormBCD(t *testing.T, dir, gatewayURL, site string, pins map[string]any) stormBCD {
	t.Helper()
	return newBCDIn(t, dir, "bcd", gatewayURL, site, pins)
}

// newBCDIn is newStormBCD in dir/sub, for daemons that each keep their
// own config (bcd rewrites it as it learns rotated keys).
func newBCDIn(t *testing.T, dir, sub, gatewayURL, site string, pins map[string]any) stormBCD {
	t.Helper()
	bcdDir := filepath.Join(dir, sub)
	must(t, os.MkdirAll(bcdDir, 0o700))
	jwk, err := os.ReadFile(filepath.Join(dir, "pki", bcdconfig.EncryptionKeyFile))
	must(t, err)
	must(t, os.WriteFile(filepath.Join(bcdDir, bcdconfig.EncryptionKeyFile), jwk, 0o644))
	conf := filepath.Join(bcdDir, "config.toml")
	must(t, os.WriteFile(conf, []byte(fmt.Sprintf(
		"gateway_url = %q\nsite = %q\nserving_ca_spki_pin = %q\njoin_signing_key_pin = %q\njoin_encryption_key_pin = %q\n",
		gatewayURL, site, pins["servingCaPin"], pins["joinSigningKeyPin"], pins["joinEncryptionKeyPin"])), 0o600))
	bcfg, err := bcdconfig.Load(conf)
	must(t, err)
	encKey, found, err := bcdconfig.LoadEncryptionKey(bcdDir, bcfg.JoinEncryptionKeyPin)
	if err != nil || !found {
		t.Fatalf("encryption key: %v (found %v)", err, found)
	}
	tlsConf, err := enroll.PinnedTLSConfig(bcfg.ServingCAPins(), "127.0.0.1", time.Now)
	must(t, err)
	return stormBCD{Conf: conf, Config: bcfg, EncKey: encKey, TLS: tlsConf}
}

// jsonCLI returns a runner of the CLI bc with env that adds --json, fails
// the test on a non-zero exit and returns the parsed answer.
func jsonCLI(t *testing.T, bc string, env []string) func(args ...string) map[string]any {
	return func(args ...string) map[string]any {
		t.Helper()
		out, errOut, code := run(t, env, "", bc, append(args, "--json")...)
		if code != 0 {
			t.Fatalf("%v: %s", args, errOut)
		}
		return jsonOf(t, out)
	}
}
