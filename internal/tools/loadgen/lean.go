package loadgen

// Lean hold mode (HoldOptions.Lean): the machines join as in hold mode,
// then each simulated daemon holds a real session through the gateway
// with a fraction of what bcd's own loop costs (a goroutine per session,
// per command watcher and per renewer, net/http's HTTP/2 client, a parsed
// identity re-read from disk), so that one box can hold a region:
//
//   - one TLS connection per daemon presenting its node certificate, over
//     h2upstream (the gateway's multiplexing gRPC client: one read
//     goroutine per connection, callbacks, an idle stream is a struct);
//   - the session protocol from nodesession, bcd's own: Hello signed over
//     the API's nonce with the heartbeat key offer, heartbeats at the
//     interval Welcome names (MAC'd when Welcome carries the API's key,
//     else signed), commands verified as bcd verifies them (run.Verify,
//     the command bundle from the join) and answered signed by the node
//     key, after running as bcd runs them (run.Execute);
//   - renewals at 45% to 75% of the lifetime (renew.DueAt), each a
//     JoinService.Renew call on the session's connection (as bcd's
//     renewer uses renew.SessionConn) built by renew.NewRequest and
//     checked by enroll.VerifyRenewResponse; then, as bcd, the session on
//     the old certificate ends and the next opens at once on a new TLS
//     connection with the new one;
//   - after any other end, the reconnect waits of nodesession
//     (the first drawn from [0, 10 s), then the backoff with jitter);
//   - every wait is a timer of the injected clock (clock.AfterFunc): no
//     goroutine waits for a daemon.
//
// What a daemon keeps between events is its key, its certificate chain
// (DER), its connection and a few fields; the command bundle is shared by
// the daemons of a site. Unlike bcd it keeps no identity on disk and no
// record of the commands it ran (a command delivered twice runs twice),
// and resumes no TLS session.

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"net/http"
	"net/url"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/gateway/h2upstream"
	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/nodesession"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/backoff"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// Lean daemons' bounds, bcd's.
const (
	// leanHandshakeTimeout bounds a dial and its TLS handshake.
	leanHandshakeTimeout = 15 * time.Second
	// leanPingInterval and leanPingTimeout: the keepalive of bcd's
	// session transport.
	leanPingInterval = 60 * time.Second
	leanPingTimeout  = 20 * time.Second
	// leanReadBuffer is a connection's read buffer: TLS buffers a record
	// below it, and a frame larger than the buffer is read past it.
	leanReadBuffer = 512
	// leanRenewTimeout bounds one Renew call.
	leanRenewTimeout = 2 * time.Minute
)

// leanHolder is the lean hold mode's process-wide state.
type leanHolder struct {
	h      *holder
	tg     *target
	ctx    context.Context
	clock  clock.Clock
	log    *slog.Logger
	rand   func() float64
	pins   leanPins
	addr   string // the gateway's host:port, also the :authority
	procfs string
	nodes  []*leanNode
	// wg counts the timers armed or firing, the messages being handled
	// and the connections being closed: stop waits for them.
	wg sync.WaitGroup
}

// leanPins are the pins every daemon of the holder holds, read once:
// a lean daemon learns none (bcd's daemon keeps its own config.Pins, one
// per process). Every Hello and every renewal reads them, so they are
// not behind config.Pins' lock: after a kill of the API or a gateway,
// thousands of daemons answer their Challenges and retry their renewals
// at once, and one lock that a holder can keep while the garbage
// collector parks it (config.Pins.Held allocates under it) queued them
// all behind it for tens of seconds. The slices are clipped: nobody may
// append to them in place.
type leanPins struct {
	held, signing, retired []string
}

func newLeanPins(p *config.Pins) leanPins {
	return leanPins{held: slices.Clip(p.Held()), signing: slices.Clip(p.Set(pki.KindJoinSigning)), retired: slices.Clip(p.Retired())}
}

// leanSite is what the daemons of one site share: the command-signing
// bundle (parsed once) and the names a renewal answer must keep.
type leanSite struct {
	bundle                  []*x509.Certificate
	trustDomain, site, role string
}

// leanNode is one simulated daemon.
type leanNode struct {
	lh *leanHolder
	st *heldNode
	mu sync.Mutex
	// The identity: the key, the chain (DER, leaf first) and its validity,
	// the generation commands must name; serial counts the renewals
	// saved (each a new certificate).
	key                 *ecdsa.PrivateKey
	chain               [][]byte
	notBefore, notAfter time.Time
	generation          int64
	joinedAt            time.Time
	site                *leanSite
	serial              uint64
	// The session: its connection (one per session, as bcd), the session
	// itself, the failures in a row and the heartbeat interval of the
	// last Welcome.
	client   *h2upstream.Client
	sess     *leanSession
	failures int
	beat     time.Duration
	// waiting: no session, the certificate expires before the next
	// heartbeat; the renewal reconnects.
	waiting bool
	exited  bool
	// The timers: the next connect, the next renewal (attempt).
	reconnect, renewal clock.Timer
	renewFailures      int
	// pending is the next key and its CSR, sent again until a renewal
	// from this certificate is saved (as bcd's renewer keeps it).
	pending *leanNextKey
}

type leanNextKey struct {
	key *ecdsa.PrivateKey
	csr []byte
}

// holdLean holds a lean daemon for each joined machine of ms until ctx
// ends. ms's entries are dropped as they are taken over.
func holdLean(ctx context.Context, h *holder, tg *target, ms []*machine, opts HoldOptions, progress func(string)) error {
	u, err := url.Parse(tg.bc.GatewayURL)
	if err != nil {
		return err
	}
	lh := &leanHolder{h: h, tg: tg, ctx: ctx, clock: opts.Clock, log: slog.New(slog.DiscardHandler), rand: mrand.Float64,
		pins: newLeanPins(config.NewPins("", tg.bc, nil)), addr: u.Host, procfs: tg.bc.ProcfsRoot}
	if lh.clock == nil {
		lh.clock = clock.Real{}
	}
	sites := map[string]*leanSite{}
	statuses := make([]*heldNode, 0, len(ms))
	for i, m := range ms {
		if m.body == nil {
			continue
		}
		n, err := lh.add(m, sites)
		if err != nil {
			return fmt.Errorf("machine %d: %w", i, err)
		}
		ms[i] = nil // the join's request and answer are not kept
		lh.nodes = append(lh.nodes, n)
		statuses = append(statuses, n.st)
	}
	h.mu.Lock()
	h.nodes = statuses
	h.mu.Unlock()
	// The join phase's garbage (requests, answers, connections) goes back
	// to the system before the daemons start: what stays is theirs.
	debug.FreeOSMemory()
	defer lh.stop()
	var pace <-chan time.Time
	if opts.StartRate > 0 {
		t := time.NewTicker(time.Duration(float64(time.Second) / opts.StartRate))
		defer t.Stop()
		pace = t.C
	}
	for _, n := range lh.nodes {
		if pace != nil {
			select {
			case <-pace:
			case <-ctx.Done():
				return nil
			}
		}
		h.running.Add(1)
		n.mu.Lock()
		n.scheduleRenewalLocked()
		n.reconnect = lh.after(0, n.connect)
		n.mu.Unlock()
	}
	progress(fmt.Sprintf("%d lean daemons running", len(lh.nodes)))
	<-ctx.Done()
	progress("stopping the daemons…")
	return nil
}

// add makes the daemon of a joined machine, sharing its site's bundle.
func (lh *leanHolder) add(m *machine, sites map[string]*leanSite) (*leanNode, error) {
	b := m.body
	chain := slices.Clone(b.GetCertChain())
	if len(chain) == 0 {
		return nil, errors.New("the join answer has no certificate")
	}
	leaf, err := x509.ParseCertificate(chain[0])
	if err != nil {
		return nil, err
	}
	key := fmt.Sprintf("%s\x00%s\x00%s\x00%x", b.GetTrustDomain(), b.GetSiteId(), b.GetRole(), bytes.Join(b.GetCommandBundle(), nil))
	s := sites[key]
	if s == nil {
		s = &leanSite{trustDomain: b.GetTrustDomain(), site: b.GetSiteId(), role: b.GetRole()}
		for _, der := range b.GetCommandBundle() {
			c, err := x509.ParseCertificate(der)
			if err != nil {
				return nil, fmt.Errorf("command bundle: %w", err)
			}
			s.bundle = append(s.bundle, c)
		}
		sites[key] = s
	}
	return &leanNode{lh: lh, st: &heldNode{id: b.GetNodeId()}, key: m.key, chain: chain, notBefore: leaf.NotBefore, notAfter: leaf.NotAfter,
		generation: b.GetIdentityGeneration(), joinedAt: time.Now(), site: s}, nil
}

// after runs f after d on the clock, counted in wg; nil once ctx ended.
func (lh *leanHolder) after(d time.Duration, f func()) clock.Timer {
	if lh.ctx.Err() != nil {
		return nil
	}
	lh.wg.Add(1)
	return lh.clock.AfterFunc(d, func() {
		defer lh.wg.Done()
		if lh.ctx.Err() == nil {
			f()
		}
	})
}

// cancel stops t if it has not fired yet.
func (lh *leanHolder) cancel(t clock.Timer) {
	if t != nil && t.Stop() {
		lh.wg.Done()
	}
}

// stop ends every daemon (ctx ended: nothing new is armed) and waits for
// everything the holder started.
func (lh *leanHolder) stop() {
	for _, n := range lh.nodes {
		n.mu.Lock()
		cl := n.client
		n.client = nil
		lh.cancel(n.reconnect)
		lh.cancel(n.renewal)
		n.reconnect, n.renewal = nil, nil
		if s := n.sess; s != nil {
			lh.cancel(s.timer)
			s.timer = nil
		}
		n.mu.Unlock()
		if cl != nil {
			_ = cl.Close()
		}
	}
	lh.wg.Wait()
}

// clientConfig is a session's connection: TLS pinned to the serving CA
// presenting the node certificate, one connection, bcd's keepalive.
func (lh *leanHolder) clientConfig(key *ecdsa.PrivateKey, chain [][]byte) h2upstream.Config {
	tc := lh.tg.tlsConf.Clone()
	tc.Certificates = []tls.Certificate{{Certificate: chain, PrivateKey: key}}
	tc.ClientSessionCache = nil
	// A small read buffer, and no HPACK table either way (as bcd's
	// transport): the connection carries a session and the odd renewal.
	return h2upstream.Config{Addr: lh.addr, TLS: tc, Clock: lh.clock, Log: lh.log, Conns: 1,
		HandshakeTimeout: leanHandshakeTimeout, PingInterval: leanPingInterval, PingTimeout: leanPingTimeout,
		ReadBufferSize: leanReadBuffer, HeaderTableSize: 1}
}

// connect opens a session on the current certificate, unless one is
// open, the certificate expired (the daemon exits, as bcd) or expires
// before the next heartbeat (the renewal reconnects, as bcd).
func (n *leanNode) connect() {
	lh := n.lh
	n.mu.Lock()
	n.reconnect = nil
	if lh.ctx.Err() != nil || n.exited || n.sess != nil {
		n.mu.Unlock()
		return
	}
	now := lh.clock.Now()
	if !now.Before(n.notAfter) {
		n.exitLocked()
		n.mu.Unlock()
		lh.h.noteError(errors.New("daemon exited: the certificate expired"))
		return
	}
	if n.notAfter.Sub(now) < n.marginLocked() {
		n.waiting = true
		n.mu.Unlock()
		return
	}
	cl, err := h2upstream.New(lh.clientConfig(n.key, n.chain))
	if err != nil {
		n.mu.Unlock()
		lh.h.noteError(err)
		return
	}
	s := &leanSession{n: n, serial: n.serial, key: n.key, leaf: n.chain[0], start: now}
	n.client, n.sess = cl, s
	n.mu.Unlock()
	stream, err := cl.Open(lh.ctx, h2upstream.Request{Path: agentv1connect.SessionServiceConnectProcedure, Authority: lh.addr}, s)
	if err != nil {
		s.end(fmt.Errorf("session through %s: %w", lh.addr, err))
		return
	}
	n.mu.Lock()
	s.stream = stream
	doomed := s.cause != nil && !s.ended
	n.mu.Unlock()
	if doomed {
		stream.Reset()
	}
}

// marginLocked is how long before its expiry a certificate opens no
// session: the heartbeat interval, at most a quarter of the lifetime.
func (n *leanNode) marginLocked() time.Duration {
	beat := n.beat
	if beat <= 0 {
		beat = nodesession.DefaultHeartbeat
	}
	return min(beat, n.notAfter.Sub(n.notBefore)/4)
}

// exitLocked ends the daemon for good: its certificate expired.
func (n *leanNode) exitLocked() {
	if n.exited {
		return
	}
	n.exited = true
	n.lh.cancel(n.renewal)
	n.renewal = nil
	n.st.up.Store(false)
	n.lh.h.exited.Add(1)
	n.lh.h.running.Add(-1)
}

// leanSession is one session of a lean daemon: its stream's handler.
type leanSession struct {
	n *leanNode
	// The certificate it presents.
	serial uint64
	key    *ecdsa.PrivateKey
	leaf   []byte
	start  time.Time
	// The rest is under n.mu.
	stream  *h2upstream.Stream
	opening *nodesession.Opening
	beats   *nodesession.Beats
	beat    time.Duration
	seq     uint64
	timer   clock.Timer
	// cause is why the daemon ends the session (set before its reset).
	cause error
	ended bool
}

var errRenewed = errors.New("the certificate was renewed")

// OnHeaders: the session's headers say nothing.
func (s *leanSession) OnHeaders(*h2upstream.Stream, http.Header) {}

// OnSent: nothing waits for a message to leave.
func (s *leanSession) OnSent(*h2upstream.Stream, int) {}

// OnTrailers: the API (or the gateway) ended the session.
func (s *leanSession) OnTrailers(_ *h2upstream.Stream, st h2upstream.Status) {
	s.end(fmt.Errorf("session through %s: %s (gRPC status %d)", s.n.lh.addr, st.Message, st.Code))
}

// OnReset: the stream or its connection failed, or the daemon ended it.
func (s *leanSession) OnReset(_ *h2upstream.Stream, err error) {
	s.end(fmt.Errorf("session through %s: %w", s.n.lh.addr, err))
}

// OnMessage hands a message of the API's to a goroutine of its own: the
// signatures, the key agreement and the commands run off the
// connection's goroutine, whose stack they would grow for good.
func (s *leanSession) OnMessage(st *h2upstream.Stream, msg []byte, window int) {
	defer st.Consumed(window)
	m := &agentv1.SessionServerMessage{}
	if err := proto.Unmarshal(msg, m); err != nil {
		s.fail(st, fmt.Errorf("the gateway sent an unreadable session message: %w", err))
		return
	}
	lh := s.n.lh
	switch {
	case m.GetChallenge() != nil:
		lh.wg.Go(func() { s.hello(st, m.GetChallenge().GetNonce()) })
	case m.GetWelcome() != nil:
		lh.wg.Go(func() { s.welcome(st, m.GetWelcome()) })
	case m.GetCommand() != nil:
		lh.wg.Go(func() { s.command(st, m.GetCommand()) })
	}
}

// fail ends the session with err: the stream is reset, and OnReset ends
// it.
func (s *leanSession) fail(st *h2upstream.Stream, err error) {
	s.n.mu.Lock()
	if s.cause == nil {
		s.cause = err
	}
	s.n.mu.Unlock()
	if st != nil {
		st.Reset()
	}
}

// send sends one message; false when the stream is gone (its end follows
// through the handler).
func (s *leanSession) send(st *h2upstream.Stream, m *agentv1.SessionClientMessage) bool {
	b, err := proto.Marshal(m)
	if err == nil {
		err = st.Send(b)
	}
	switch {
	case err == nil:
		return true
	case errors.Is(err, h2upstream.ErrStreamEnded):
	default:
		s.fail(st, fmt.Errorf("send: %w", err))
	}
	return false
}

// hello answers the Challenge as bcd does (nodesession.Answer).
func (s *leanSession) hello(st *h2upstream.Stream, nonce []byte) {
	n := s.n
	opening, hello, err := nodesession.Answer(s.key, n.st.id, s.leaf, nonce, n.lh.pins.held)
	if errors.Is(err, nodesession.ErrNoChallenge) {
		err = fmt.Errorf("the gateway %s opened the session without the control plane's challenge", n.lh.addr)
	}
	if err != nil {
		s.fail(st, err)
		return
	}
	n.mu.Lock()
	if s.ended || s.opening != nil || s.beats != nil {
		n.mu.Unlock()
		return
	}
	s.opening = opening
	n.mu.Unlock()
	s.send(st, &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Hello{Hello: hello}})
}

// welcome takes the API's Welcome: the heartbeats start.
func (s *leanSession) welcome(st *h2upstream.Stream, w *agentv1.Welcome) {
	n := s.n
	lh := n.lh
	n.mu.Lock()
	opening := s.opening
	n.mu.Unlock()
	if opening == nil || w.GetNodeId() != n.st.id {
		s.fail(st, errors.New("the gateway answered Hello without this node's Welcome"))
		return
	}
	beats, beat, err := opening.Welcomed(w)
	if err != nil {
		s.fail(st, fmt.Errorf("the gateway %s relayed a Welcome with an unusable heartbeat key: %w", lh.addr, err))
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if s.ended || s.beats != nil {
		return
	}
	s.beats, s.beat, s.opening = beats, beat, nil
	n.beat = beat
	s.timer = lh.after(beat, func() { s.heartbeat(st) })
	lh.h.welcomes.Add(1)
	n.st.welcomed.Store(time.Now().UnixNano())
	n.st.up.Store(true)
}

// heartbeat sends the next heartbeat and arms the one after it.
func (s *leanSession) heartbeat(st *h2upstream.Stream) {
	n := s.n
	n.mu.Lock()
	if s.ended {
		n.mu.Unlock()
		return
	}
	s.seq++
	seq, beats := s.seq, s.beats
	s.timer = n.lh.after(s.beat, func() { s.heartbeat(st) })
	n.mu.Unlock()
	hb, err := beats.Make(seq)
	if err != nil {
		s.fail(st, fmt.Errorf("sign a heartbeat: %w", err))
		return
	}
	if s.send(st, &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Heartbeat{Heartbeat: hb}}) {
		n.lh.h.heartbeats.Add(1)
	}
}

// command verifies a command as bcd does (run.Verify, under the site's
// command bundle), runs it as bcd runs it (run.Execute) unless refused,
// and answers it signed by the session's node key.
func (s *leanSession) command(st *h2upstream.Stream, sc *agentv1.SignedCommand) {
	n := s.n
	lh := n.lh
	n.mu.Lock()
	id := &identity.Identity{NodeID: n.st.id, IdentityGeneration: n.generation, JoinedAt: n.joinedAt, Bundle: n.site.bundle}
	n.mu.Unlock()
	body, refused := run.Verify(id, sc, lh.clock.Now())
	res := &agentv1.CommandResult{CommandId: body.GetCommandId(), Error: refused}
	if refused == "" {
		out, err := run.Execute(lh.ctx, lh.procfs, body.GetKind(), body.GetArgs())
		if err != nil {
			res.Error = err.Error()
		} else {
			res.Ok, res.Output = true, out
		}
	}
	signed, err := nodesession.SignResult(s.key, id.NodeID, body.GetIdentityGeneration(), res)
	if err != nil {
		lh.h.noteError(fmt.Errorf("sign a command result: %w", err))
		return
	}
	if s.send(st, &agentv1.SessionClientMessage{Msg: &agentv1.SessionClientMessage_Result{Result: signed}}) {
		lh.h.commands.Add(1)
	}
}

// end ends the session (once) and arms the next: at once after a
// renewal, as bcd; else after nodesession's reconnect wait. Its
// connection is closed.
func (s *leanSession) end(err error) {
	n := s.n
	lh := n.lh
	n.mu.Lock()
	if s.ended {
		n.mu.Unlock()
		return
	}
	s.ended = true
	if s.cause != nil {
		err = s.cause
	}
	lh.cancel(s.timer)
	s.timer = nil
	if n.sess != s {
		n.mu.Unlock()
		return
	}
	cl := n.client
	n.sess, n.client = nil, nil
	stopping := lh.ctx.Err() != nil
	var note error // noted once n.mu is released: noteError takes the holder's lock
	if !stopping && !n.exited {
		var wait time.Duration
		if n.serial != s.serial {
			n.failures = 0 // a renewal: a fresh start, at once
		} else {
			if lh.clock.Since(s.start) >= nodesession.StableAfter {
				n.failures = 0
			}
			n.failures++
			wait = nodesession.ReconnectWait(n.failures, lh.rand())
		}
		lh.cancel(n.reconnect)
		n.reconnect = lh.after(wait, n.connect)
		// As hold mode counts bcd's session ends: one that ends after a
		// renewal saved while it was up is the renewal's.
		if n.st.up.Swap(false) && n.st.renewed.Load() >= n.st.welcomed.Load() {
			lh.h.endsRenewal.Add(1)
		} else {
			lh.h.endsOther.Add(1)
			if !errors.Is(err, errRenewed) {
				note = err
			}
		}
	}
	n.mu.Unlock()
	lh.h.noteError(note)
	if cl != nil {
		// Not on the connection's goroutine, which may be the caller.
		lh.wg.Go(func() { _ = cl.Close() })
	}
}

// scheduleRenewalLocked arms the next renewal at 45% to 75% of the
// certificate's lifetime (renew.DueAt).
func (n *leanNode) scheduleRenewalLocked() {
	lh := n.lh
	due := renew.DueAt(n.notBefore, n.notAfter, lh.rand())
	n.renewal = lh.after(due.Sub(lh.clock.Now()), n.renew)
}

// renew renews the certificate as bcd's renewer does, over the session's
// connection when a session is welcomed on it (else over a connection of
// its own), then ends that session: the next opens on the new
// certificate.
func (n *leanNode) renew() {
	lh := n.lh
	n.mu.Lock()
	n.renewal = nil
	if n.exited {
		n.mu.Unlock()
		return
	}
	key, chain, serial, next := n.key, n.chain, n.serial, n.pending
	var session *h2upstream.Client
	if s := n.sess; s != nil && s.beats != nil && s.serial == serial {
		session = n.client
	}
	n.mu.Unlock()
	if next == nil {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		var csr []byte
		if err == nil {
			csr, err = identity.NewCSR(k, n.st.id)
		}
		if err != nil {
			n.renewFailed(fmt.Errorf("make the next node key: %w", err))
			return
		}
		next = &leanNextKey{key: k, csr: csr}
		n.mu.Lock()
		n.pending = next
		n.mu.Unlock()
	}
	var body *agentv1.JoinResponseBody
	var err error
	if session != nil {
		body, err = n.renewOn(session, key, chain, next)
	}
	if session == nil || errors.Is(err, h2upstream.ErrClosed) {
		// No session on this certificate, or it ended meanwhile: a
		// connection of the renewal's own, as bcd's renewer dials.
		own, cerr := h2upstream.New(lh.clientConfig(key, chain))
		if cerr != nil {
			n.renewFailed(cerr)
			return
		}
		body, err = n.renewOn(own, key, chain, next)
		_ = own.Close()
	}
	if err != nil {
		n.renewFailed(err)
		return
	}
	n.renewed(serial, next, body)
}

// renewOn sends one renewal (renew.NewRequest) on cl and checks the
// answer as bcd does.
func (n *leanNode) renewOn(cl *h2upstream.Client, key *ecdsa.PrivateKey, chain [][]byte, next *leanNextKey) (*agentv1.JoinResponseBody, error) {
	lh := n.lh
	req, err := renew.NewRequest(key, n.st.id, chain, next.csr, lh.clock.Now(), lh.pins.held)
	if err != nil {
		return nil, err
	}
	b, err := proto.Marshal(req)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(lh.ctx, leanRenewTimeout)
	defer cancel()
	msg, err := unaryCall(ctx, cl, agentv1connect.JoinServiceRenewProcedure, lh.addr, b)
	if err != nil {
		return nil, fmt.Errorf("cannot renew through %s: %w", lh.addr, err)
	}
	res := &agentv1.RenewResponse{}
	if err := proto.Unmarshal(msg, res); err != nil {
		return nil, fmt.Errorf("an unreadable renewal answer: %w", err)
	}
	return enroll.VerifyRenewResponse(res, enroll.RenewExpectation{
		SigningPins: lh.pins.signing, CSRHash: pki.CSRHash(next.csr), NodeKey: next.key.Public(),
		TrustDomain: n.site.trustDomain, SiteID: n.site.site, NodeID: n.st.id, Role: n.site.role, Retired: lh.pins.retired,
	})
}

// renewed takes the renewed identity (from the certificate serial was)
// and ends the session on the old one, or opens the one a certificate
// about to expire was waiting for.
func (n *leanNode) renewed(serial uint64, next *leanNextKey, body *agentv1.JoinResponseBody) {
	lh := n.lh
	chain := slices.Clone(body.GetCertChain())
	leaf, err := x509.ParseCertificate(chain[0])
	if err != nil {
		n.renewFailed(err)
		return
	}
	n.mu.Lock()
	if n.serial != serial || n.exited {
		n.mu.Unlock()
		return
	}
	n.key, n.chain, n.notBefore, n.notAfter = next.key, chain, leaf.NotBefore, leaf.NotAfter
	if g := body.GetIdentityGeneration(); g > 0 {
		n.generation = g
	}
	n.serial++
	n.pending, n.renewFailures = nil, 0
	n.scheduleRenewalLocked()
	lh.h.renewed.Add(1)
	n.st.renewed.Store(time.Now().UnixNano())
	var st *h2upstream.Stream
	if s := n.sess; s != nil {
		if s.cause == nil {
			s.cause = errRenewed
		}
		st = s.stream // nil while it opens: connect resets it then
	} else if n.waiting && n.reconnect == nil {
		n.reconnect = lh.after(0, n.connect)
	}
	n.waiting = false
	n.mu.Unlock()
	if st != nil {
		st.Reset()
	}
}

// renewFailed counts a failed renewal and arms the retry as bcd's
// renewer does: the backoff with jitter, never past the expiry.
func (n *leanNode) renewFailed(err error) {
	lh := n.lh
	lh.h.renewFailed.Add(1)
	lh.h.noteError(fmt.Errorf("renewal: %w", err))
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.exited || lh.ctx.Err() != nil {
		return
	}
	n.renewFailures++
	wait := backoff.Policy{Min: renew.MinBackoff, Max: renew.MaxBackoff, Jitter: backoff.DefaultJitter}.Spread(n.renewFailures, lh.rand())
	left := n.notAfter.Sub(lh.clock.Now())
	if left <= 0 {
		n.exitLocked()
		return
	}
	n.renewal = lh.after(renew.RetryIn(wait, left, lh.rand()), n.renew)
}

// unary is one unary gRPC call's handler: its answer and its end.
type unary struct {
	msg    []byte
	status h2upstream.Status
	err    error
	done   chan struct{}
}

func (u *unary) OnHeaders(*h2upstream.Stream, http.Header) {}
func (u *unary) OnSent(*h2upstream.Stream, int)            {}
func (u *unary) OnMessage(s *h2upstream.Stream, msg []byte, window int) {
	if u.msg == nil {
		u.msg = bytes.Clone(msg)
	}
	s.Consumed(window)
}
func (u *unary) OnTrailers(_ *h2upstream.Stream, st h2upstream.Status) { u.status = st; close(u.done) }
func (u *unary) OnReset(_ *h2upstream.Stream, err error)               { u.err = err; close(u.done) }

// unaryCall makes one unary gRPC call of path on cl with the request req
// and returns the answer's message.
func unaryCall(ctx context.Context, cl *h2upstream.Client, path, authority string, req []byte) ([]byte, error) {
	u := &unary{done: make(chan struct{})}
	s, err := cl.Open(ctx, h2upstream.Request{Path: path, Authority: authority}, u)
	if err != nil {
		return nil, err
	}
	if err := s.Send(req); err == nil {
		_ = s.CloseSend()
	}
	select {
	case <-u.done:
	case <-ctx.Done():
		s.Reset()
		<-u.done
	}
	switch {
	case u.err != nil:
		return nil, u.err
	case u.status.Code != 0:
		return nil, fmt.Errorf("%s (gRPC status %d)", u.status.Message, u.status.Code)
	case u.msg == nil:
		return nil, errors.New("no answer")
	}
	return u.msg, nil
}
