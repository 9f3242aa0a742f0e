package loadgen

// Hold mode: the machines join as in join mode, then each runs bcd's own
// service loop (internal/node/run, with the certificate renewer of
// internal/node/renew) against its identity saved the way bcd join saves
// it: one TLS connection per machine presenting its node certificate, the
// API's Challenge answered with Hello signed by the node key, heartbeats
// signed at the interval Welcome names, renewals at 45% to 75% of the
// certificate's lifetime (each a call on the session's connection,
// followed by a session on the new certificate), commands verified,
// recorded and answered signed. The process serves its progress as JSON
// (HoldStatus) until interrupted; scripts/bench-fleet reads it (fleet.go).
// With HoldOptions.Lean the daemons are lean.go's instead: the same
// protocol over real TLS at a fraction of the memory.

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// HoldOptions adds what hold mode needs to Config.
type HoldOptions struct {
	// DataDir holds one identity directory per machine (DataDir/000042);
	// lean daemons keep theirs in memory and need none.
	DataDir string
	// Status is the address the status is served on (GET /status,
	// GET /nodes, and the process's profiles under /debug/pprof/).
	Status string
	// IdentityCheck is how often each daemon re-reads its identity from
	// disk (bcd's default is 30 s; the renewer tells the daemon of a
	// renewal at once either way, so a longer period only saves the
	// generator's CPU).
	IdentityCheck time.Duration
	// StartRate is how many daemons start per second (0: all at once).
	// All at once is a region's restart: on a small box the gateway
	// cannot finish that many TLS handshakes within the daemons'
	// timeouts, and the storm, not the holding, is measured.
	StartRate float64
	// Lean holds the sessions with the lean daemons of lean.go (real
	// TLS, the real protocol, a fraction of the memory) instead of bcd's
	// own loop: what holding 100,000 nodes on one box needs.
	Lean bool
	// Clock is the lean daemons' clock (nil: the wall clock).
	Clock clock.Clock
}

// HoldStatus is what a holding process reports.
type HoldStatus struct {
	// Nodes is how many machines this process was asked to hold; Joined
	// how many joined, Running how many daemons run.
	Nodes   int `json:"nodes"`
	Joined  int `json:"joined"`
	Running int `json:"running"`
	// Up is the sessions open now (welcomed, not ended); UpSince those of
	// them welcomed at or after the query's since (unix nanoseconds).
	Up      int `json:"up"`
	UpSince int `json:"upSince"`
	// Welcomes counts sessions opened; EndsRenewal sessions ended for a
	// renewal (the daemon reconnects with its new certificate at once);
	// EndsOther every other end (a failure: the daemon backs off).
	Welcomes    int64 `json:"welcomes"`
	EndsRenewal int64 `json:"endsRenewal"`
	EndsOther   int64 `json:"endsOther"`
	// Renewed and RenewFailed count the renewers' attempts; Exited the
	// daemons whose loop returned (an expired or unusable identity: a
	// node lost).
	Renewed     int64 `json:"renewed"`
	RenewFailed int64 `json:"renewFailed"`
	Exited      int64 `json:"exited"`
	// Heartbeats and Commands count the heartbeats sent and the command
	// results sent (lean daemons only: bcd's loop does not tell).
	Heartbeats int64 `json:"heartbeats,omitempty"`
	Commands   int64 `json:"commands,omitempty"`
	// Errors counts distinct errors (at most maxErrorKinds kinds).
	Errors map[string]int `json:"errors,omitempty"`
}

const maxErrorKinds = 20

// ephemeralPort matches an address's port in "tcp A->B" (the client's).
var ephemeralPort = regexp.MustCompile(`(\d+\.\d+\.\d+\.\d+):\d+->`)

// heldNode is one simulated bcd's state as the status reports it.
type heldNode struct {
	id       string
	up       atomic.Bool
	welcomed atomic.Int64 // unix nanoseconds of the last Welcome
	renewed  atomic.Int64 // unix nanoseconds of the last renewal saved
}

// holder is a holding process's state.
type holder struct {
	wantNodes             int
	running               atomic.Int64
	welcomes, endsRenewal atomic.Int64
	endsOther, renewed    atomic.Int64
	renewFailed, exited   atomic.Int64
	heartbeats, commands  atomic.Int64
	mu                    sync.Mutex
	nodes                 []*heldNode // set once the machines joined
	errors                map[string]int
}

func (h *holder) noteError(err error) {
	if err == nil {
		return
	}
	// One kind per error, not per connection: ports differ. The
	// expression runs before the lock: thousands of daemons fail at once
	// when a gateway or the API dies, and each would hold every other
	// behind it (and behind a collection that parks it meanwhile).
	msg := ephemeralPort.ReplaceAllString(err.Error(), "$1:*->")
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.errors[msg]; ok || len(h.errors) < maxErrorKinds {
		h.errors[msg]++
	}
}

// status is the current HoldStatus; since counts the sessions welcomed at
// or after it.
func (h *holder) status(since int64) HoldStatus {
	h.mu.Lock()
	nodes := h.nodes
	h.mu.Unlock()
	st := HoldStatus{Nodes: h.wantNodes, Joined: len(nodes), Running: int(h.running.Load()),
		Welcomes: h.welcomes.Load(), EndsRenewal: h.endsRenewal.Load(), EndsOther: h.endsOther.Load(),
		Renewed: h.renewed.Load(), RenewFailed: h.renewFailed.Load(), Exited: h.exited.Load(),
		Heartbeats: h.heartbeats.Load(), Commands: h.commands.Load()}
	for _, n := range nodes {
		if n.up.Load() {
			st.Up++
			if n.welcomed.Load() >= since {
				st.UpSince++
			}
		}
	}
	h.mu.Lock()
	if len(h.errors) > 0 {
		st.Errors = make(map[string]int, len(h.errors))
		for k, v := range h.errors {
			st.Errors[k] = v
		}
	}
	h.mu.Unlock()
	return st
}

func (h *holder) serveHTTP(w http.ResponseWriter, r *http.Request) {
	var v any
	switch r.URL.Path {
	case "/status":
		since, _ := strconv.ParseInt(r.URL.Query().Get("since"), 10, 64)
		v = h.status(since)
	case "/nodes":
		h.mu.Lock()
		nodes := h.nodes
		h.mu.Unlock()
		ids := make([]string, 0, len(nodes))
		for _, n := range nodes {
			ids = append(ids, n.id)
		}
		v = ids
	default:
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// Hold joins cfg.Machines machines, then runs a bcd service loop for each
// until ctx ends. The status is served on opts.Status from the start.
func Hold(ctx context.Context, cfg Config, opts HoldOptions, progress func(string)) error {
	if progress == nil {
		progress = func(string) {}
	}
	if cfg.Machines <= 0 || cfg.Concurrency <= 0 {
		return errs.New(errs.InvalidArgument, "machines and concurrency must be positive")
	}
	if opts.DataDir == "" && !opts.Lean || opts.Status == "" {
		return errs.New(errs.InvalidArgument, "hold mode needs a data directory and a status address")
	}
	if opts.IdentityCheck <= 0 {
		opts.IdentityCheck = 30 * time.Second
	}
	tg, err := loadTarget(cfg.BCDConfig)
	if err != nil {
		return err
	}
	h := &holder{errors: map[string]int{}, wantNodes: cfg.Machines}
	ln, err := net.Listen("tcp", opts.Status)
	if err != nil {
		return err
	}
	// The status, and the profiles of the simulated daemons (what a held
	// node costs the load generator: GET /debug/pprof/heap).
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.Handle("/", http.HandlerFunc(h.serveHTTP))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	var serving sync.WaitGroup
	serving.Add(1)
	go func() { defer serving.Done(); _ = srv.Serve(ln) }()
	defer func() { _ = srv.Close(); serving.Wait() }()

	jcfg := cfg
	jcfg.NewConnections, jcfg.Verify = false, true
	r, ms, err := runJoin(ctx, jcfg, tg, progress)
	if err != nil {
		return err
	}
	progress(fmt.Sprintf("joined %d, refused %d, failed %d in %.1f s; starting the daemons…", r.Joined, r.Refused, r.Failed, r.Seconds))
	for e, n := range r.Errors {
		h.noteError(fmt.Errorf("join (x%d): %s", n, e))
	}
	if opts.Lean {
		return holdLean(ctx, h, tg, ms, opts, progress)
	}
	var daemons sync.WaitGroup
	defer daemons.Wait()
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	nodes := make([]*heldNode, 0, len(ms))
	type started struct {
		n *heldNode
		d *run.Daemon
	}
	var ds []started
	// The daemons of this process share one config.toml, so one live pin
	// set, as bcd run's session and renewer share theirs.
	pins := config.NewPins("", tg.bc, nil)
	for i, m := range ms {
		if m.body == nil {
			continue
		}
		n, d, err := h.daemon(tg, filepath.Join(opts.DataDir, fmt.Sprintf("%06d", i)), m, opts, pins)
		if err != nil {
			return fmt.Errorf("machine %d: %w", i, err)
		}
		nodes = append(nodes, n)
		ds = append(ds, started{n, d})
	}
	h.mu.Lock()
	h.nodes = nodes
	h.mu.Unlock()
	var pace <-chan time.Time
	if opts.StartRate > 0 {
		t := time.NewTicker(time.Duration(float64(time.Second) / opts.StartRate))
		defer t.Stop()
		pace = t.C
	}
	for _, s := range ds {
		if pace != nil {
			select {
			case <-pace:
			case <-ctx.Done():
				return nil
			}
		}
		daemons.Add(1)
		h.running.Add(1)
		go func() {
			defer daemons.Done()
			defer h.running.Add(-1)
			err := s.d.Run(ctx)
			if ctx.Err() == nil {
				h.exited.Add(1)
				s.n.up.Store(false)
				h.noteError(fmt.Errorf("daemon exited: %w", err))
			}
		}()
	}
	progress(fmt.Sprintf("%d daemons running", len(ds)))
	<-ctx.Done()
	progress("stopping the daemons…")
	return nil
}

// daemon saves m's identity in dir as bcd join does and returns bcd run's
// loop for it, with its renewer, wired to h's counters.
func (h *holder) daemon(tg *target, dir string, m *machine, opts HoldOptions, pins *config.Pins) (*heldNode, *run.Daemon, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(m.key)
	if err != nil {
		return nil, nil, err
	}
	keyRecord := pem.EncodeToMemory(&pem.Block{Type: identity.PEMTypeSoftware, Bytes: der})
	chainPEM := pki.ChainPEM(m.body.GetCertChain())
	bundlePEM := pki.ChainPEM(m.body.GetCommandBundle())
	id, err := identity.NewIdentity(chainPEM, identity.AttestorJoinToken, time.Now())
	if err != nil {
		return nil, nil, err
	}
	id.IdentityGeneration = m.body.GetIdentityGeneration()
	store := &identity.Store{Dir: dir}
	n := &heldNode{id: id.NodeID}
	if err := store.Save(id, keyRecord, chainPEM, bundlePEM); err != nil {
		return nil, nil, err
	}
	serverTime := servertime.New(servertime.Config{Dir: dir})
	tickets := &enroll.TicketCache{}
	conn := &renew.SessionConn{}
	renewed := make(chan struct{}, 1)
	rn, err := renew.New(renew.Config{BCD: tg.bc, Store: store, ServerTime: serverTime, Tickets: tickets, Session: conn, Pins: pins,
		OnRenewed: func(*identity.Identity) {
			h.renewed.Add(1)
			n.renewed.Store(time.Now().UnixNano())
			select {
			case renewed <- struct{}{}:
			default:
			}
		},
		OnFailed: func(err error) { h.renewFailed.Add(1); h.noteError(fmt.Errorf("renewal: %w", err)) }})
	if err != nil {
		return nil, nil, err
	}
	d, err := run.New(run.Config{BCD: tg.bc, Store: store, ServerTime: serverTime, Renewer: rn, Renewed: renewed, Tickets: tickets, SessionConn: conn, Pins: pins,
		IdentityCheck: opts.IdentityCheck,
		OnWelcome: func(string) {
			h.welcomes.Add(1)
			n.welcomed.Store(time.Now().UnixNano())
			n.up.Store(true)
		},
		OnSessionEnded: func(err error) {
			// A renewal saved while a welcomed session was up ended it
			// (the daemon saw the new identity, or the API ended the
			// session the renewal superseded).
			if n.up.Swap(false) && n.renewed.Load() >= n.welcomed.Load() {
				h.endsRenewal.Add(1)
				return
			}
			h.endsOther.Add(1)
			h.noteError(err)
		}})
	return n, d, err
}
