// Package session is the API side of node sessions (R12.1) and command
// delivery (R12.3): SessionService.Connect, served on the agent listener
// next to JoinService and reached through a gateway. The API server
// (internal/controlplane/api builds the service; internal/controlplane/server runs its Listener) and
// the controllers (WorkAccept) import it; nothing on the node or the
// gateway does. Connect holds a session on connect-go; with [agent] http2
// = "framer" the agent listener holds it on h2server's callbacks instead
// (callbacks.go, Streams), running the same steps without a goroutine
// while the session is idle.
//
// A session is authenticated by the node certificate the daemon presented
// to the gateway (forwarded in Bc-Peer-Certificate): it must be byte for
// byte a node_certs row, unrevoked, unexpired (injected clock), of the
// node's current identity generation, and the node not retired. Then the
// service sends Challenge, a fresh nonce, and the daemon's Hello must carry
// the node key's signature over it (proof.go): the certificate is public,
// and the gateway that forwards it is not trusted, so without the proof a
// relay holding only the certificate could open the node's session.
// Anything else is refused with ACCESS_DENIED "Session refused" and a
// rate-limited security.session.refused event carrying the reason. The
// one exception: a retired node that proves its key is told so (INVALID_STATE
// "This node was retired"), so bcd stops instead of reconnecting forever.
//
// Heartbeats are signed by the node key over the nonce and a rising
// sequence number, or, where Config.HeartbeatMAC is on and the daemon
// offered a key in Hello, MAC'd under a key only the daemon and this
// process hold (pki.DeriveHeartbeatKey: the daemon's X25519 key bound by
// its Hello proof, the API's ephemeral one in Welcome), and only verified
// heartbeats and signed results count as the node being there: a relay
// cannot keep a session open after its daemon went away (a bad heartbeat
// ends the session: heartbeat-signature, or heartbeat-mac on a keyed
// session; none ends it as idle after three heartbeat intervals).
//
// After Hello the node is marked connected (one transaction with the
// node.connected event and audit row and, for an adopting node of a pool
// with acceptance checks, the "accept" work item: R4.5/R12.2), and marked
// disconnected, with node.disconnected and its audit row naming why, when
// the stream ends.
//
// Sessions end within a second of a reclaim, revocation or retirement
// (held.go): the process that made the change calls EndNode, and every
// replica reads the session change feed every Check (default 500 ms) and
// checks against the database the sessions it holds of the nodes the feed
// names, so a change made on another replica ends them too; a full check
// of every held session runs every minute as the safety net.
//
// Commands are rows of the commands table, written by controllers and the
// operator API. The session that holds a node's stream on this replica
// delivers its queued commands, signed with the command-signing key and
// naming the node, its identity generation and the command's unique id.
// Sessions are held in memory per replica, and a command may be queued on
// any replica; it reaches the session at once either way: a writer in this
// process calls Notify, and on PostgreSQL the transaction that queued it
// also notified the store's commands channel, which every replica's
// Listener (listen.go) LISTENs on and hands to Notify. The poll (every
// Poll) is the safety net behind both: it finds a command whose
// notification was lost (written by an older replica that does not
// notify, or queued while a listener was reconnecting and missed by its
// scan).
//
// Every command ends with a result or an expiry, and runs at most once. A
// command that was sent but not answered when its session ended goes back
// to the queue for the next session; one whose session's replica died
// before it could put it back is put back by the node's next session, on
// any replica (connected: RequeueSentCommands); one whose node never
// comes back expires (internal/controlplane/commands sweeps queued and sent commands).
// Delivering a command again is safe because bcd records each command id
// on disk before running it, and answers an id it already ran with
// "replayed" (a failed result) instead of running it again: the gateway
// and the API may deliver a command twice, bcd never runs it twice.
// Results must be signed by the node key of the session's certificate
// (pki.CommandResultMessage): a result that does not verify is not stored
// and ends the session (reason result-signature). Results finish the row,
// with an audit row, and wake the node's work items.
package session

import (
	"bytes"
	"context"
	"crypto"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/nodeident"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// WorkAccept is the work item that runs a node's acceptance checks (R12.2).
const WorkAccept = "accept"

// Defaults.
const (
	DefaultHeartbeat = 15 * time.Second
	// DefaultPoll stays short although notifications (Notify, Listener)
	// deliver nearly every command at once: during a rolling upgrade a
	// replica of the previous release queues commands without notifying,
	// and the poll is then their only path. One indexed query per replica
	// every 3 s is cheap.
	DefaultPoll       = 3 * time.Second
	DefaultCheck      = 500 * time.Millisecond
	DefaultTouchEvery = 30 * time.Second
	// helloTimeout bounds the wait for the first message.
	helloTimeout = 30 * time.Second
	// idleBeats: a session silent this many heartbeats is ended.
	idleBeats = 3
	// maxResultBytes bounds a stored command output.
	maxResultBytes = 32 << 10
	// maxUnanswered bounds the sent commands a session remembers to put
	// back in the queue when it ends; the node's next session puts back
	// the others (RequeueSentCommands), or they expire.
	maxUnanswered = 1024
)

// Why a session ended, as node.disconnected and its audit row say.
// EndRetired, EndReclaimed and EndRevoked are EndNode's reasons.
const (
	EndRetired   = "retired"
	EndReclaimed = "reclaimed"
	EndRevoked   = "revoked"

	endClosed      = "closed" // the daemon (or its connection) ended it
	endReplaced    = "replaced"
	endSuperseded  = "superseded"
	endIdle        = "idle"
	endCertExpired = "cert-expired"
	endNodeGone    = "node-gone"
	endError       = "error"
	endShutdown    = "shutdown"
)

// errShutdown ends the sessions of a replica that is shutting down.
var errShutdown = errs.New(errs.Unavailable, "the control plane is shutting down; reconnect")

// errReplaced ends a session another one of the same node took over.
var errReplaced = errs.New(errs.Conflict, "Session replaced by a newer one")

// errRefused is the only refusal a daemon ever sees.
var errRefused = errs.New(errs.AccessDenied, "Session refused")

// Config lists the session service's dependencies.
type Config struct {
	DB     *store.DB
	Clock  clock.Clock
	Log    *slog.Logger
	Hub    *events.Hub
	Bundle *ca.Bundle // signs commands; nil: commands stay queued
	// Core is the identity core: it checks the session's certificate and
	// records refusals (nil: one of the session service's own, for tests).
	Core *nodeident.Core
	// Heartbeat is the interval announced in Welcome (default 15 s).
	Heartbeat time.Duration
	// Poll is how often queued commands nobody notified this replica of
	// are looked for (default 3 s; see DefaultPoll).
	Poll time.Duration
	// Check is how often the held sessions are checked against the
	// database (retired, reclaimed, revoked, taken over by a session on
	// another replica), and for idleness and expired certificates
	// (default 500 ms: a session ends within a second of such a change).
	Check time.Duration
	// TouchEvery throttles last_seen writes (default 30 s).
	TouchEvery time.Duration
	// HeartbeatMAC agrees a heartbeat key with each daemon that offers
	// one (Hello.heartbeat_key), whose heartbeats are then checked by
	// their MAC instead of an ECDSA signature ([session] heartbeat_mac;
	// off: every heartbeat stays signed).
	HeartbeatMAC bool
	// Metrics, when set, counts sessions opened and commands delivered.
	Metrics *apimetrics.API
}

// Service is SessionService. Build it with New.
type Service struct {
	agentv1connect.UnimplementedSessionServiceHandler
	cfg Config
	log *slog.Logger

	mu       sync.Mutex
	sessions map[string]*conn // node id -> its session on this replica
	polling  bool
	// stopPoll, closed by Close, ends the poll loop; pollDone is closed
	// when the running one returned.
	stopPoll chan struct{}
	pollDone chan struct{}
	onResult func()
	// touchQueue holds heartbeats to record; touching is set while a
	// handler writes them (touch.go).
	touchMu    sync.Mutex
	touchQueue []*conn
	touching   bool
	// active counts the Connect handlers running; closing refuses new
	// ones; drained is closed when active reaches 0 during Close.
	active  int
	closing bool
	drained chan struct{}
	// held is the poll goroutine's state of the held-session check
	// (held.go).
	held heldState
	// readers counts the goroutines reading a stream served without
	// Handler (goRead).
	readers sync.WaitGroup
}

// New returns the session service.
func New(cfg Config) *Service {
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Core == nil {
		core, err := nodeident.New(nodeident.Config{DB: cfg.DB, Bundle: cfg.Bundle, Clock: cfg.Clock, Log: cfg.Log, Hub: cfg.Hub})
		if err != nil {
			panic(fmt.Sprintf("session: identity core: %v", err))
		}
		cfg.Core = core
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = DefaultHeartbeat
	}
	if cfg.Poll <= 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.Check <= 0 {
		cfg.Check = DefaultCheck
	}
	if cfg.TouchEvery <= 0 {
		cfg.TouchEvery = DefaultTouchEvery
	}
	return &Service{cfg: cfg, log: cfg.Log, sessions: map[string]*conn{}, stopPoll: make(chan struct{}), held: newHeldState()}
}

// Handler returns the Connect handler and its path. Session streams are
// long: the handler lifts the listener's per-request read and write
// deadlines for them (liveness is the heartbeat's job). It returns only
// once the goroutines Connect started to read the stream ended (goRead).
func (s *Service) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	p, h := agentv1connect.NewSessionServiceHandler(s, opts...)
	return p, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		_ = rc.SetReadDeadline(time.Time{})
		_ = rc.SetWriteDeadline(time.Time{})
		var readers sync.WaitGroup
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), readersKey{}, &readers)))
		readers.Wait()
	})
}

// readersKey carries, in a request's context, the WaitGroup of the
// goroutines reading its stream (Handler).
type readersKey struct{}

// goRead runs read, a loop on the stream's Receive, in a goroutine. A
// Receive ends only when the request body is closed, which connect-go
// does once Connect returned, so Connect cannot wait for it: Handler does,
// after the connect handler returned. Served otherwise, read is counted
// in the service's readers, which Close waits for.
func (s *Service) goRead(ctx context.Context, read func()) {
	wg, ok := ctx.Value(readersKey{}).(*sync.WaitGroup)
	if !ok {
		wg = &s.readers
	}
	wg.Go(read)
}

// OnResult sets a function called after a command result committed (the
// server wakes its controller with it).
func (s *Service) OnResult(fn func()) {
	s.mu.Lock()
	s.onResult = fn
	s.mu.Unlock()
}

// Held returns how many sessions this replica holds now (the
// bc_sessions_held gauge: an operator sees where sessions are, and how
// many moved when a replica or gateway went away).
func (s *Service) Held() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}

// Notify tells the node's session on this replica, if any, to deliver its
// queued commands now.
func (s *Service) Notify(nodeID string) {
	s.mu.Lock()
	c := s.sessions[nodeID]
	s.mu.Unlock()
	if c != nil {
		c.kickNow()
	}
}

// Connected reports whether this replica holds a session of the node.
func (s *Service) Connected(nodeID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sessions[nodeID] != nil
}

// Count returns the sessions held by this replica.
func (s *Service) Count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}

// conn is one live session.
type conn struct {
	id         string
	nodeID     string
	tenantID   string
	siteID     string
	role       string // the certificate's role: a site agent reports booted machines
	lastReport uint64 // the last site report's sequence number (the handler goroutine's own)
	generation int
	serial     string
	nodeKey    crypto.PublicKey // the certificate's key: results and heartbeats verify under it
	// issuerKeyID and issuer name the node CA that issued the session's
	// certificate: retiring that CA ends the session (R21.2).
	issuerKeyID, issuer []byte
	nonce               []byte // the session's challenge: heartbeats are signed over it
	lastSeq             uint64 // the last heartbeat's sequence number (the handler goroutine's own)
	// mac checks the heartbeats of a session that agreed a heartbeat key
	// (nil: they are signed; the handler goroutine's own).
	mac          *pki.HeartbeatMAC
	notAfter     time.Time
	allowedKinds []string
	// kick wakes a Connect handler to deliver; a session on callbacks
	// has onKick instead, which schedules the delivery.
	kick      chan struct{}
	onKick    func()
	cancel    context.CancelCauseFunc
	lastRecv  atomic.Int64 // unix ms, injected clock
	lastTouch time.Time    // the handler goroutine's own
	// sent holds the commands this session sent that are not answered
	// yet (the handler goroutine's own): they go back to the queue when
	// the session ends.
	sent map[string]struct{}

	// regSeq is the session's registration number (held.go's cut).
	regSeq uint64

	endMu     sync.Mutex
	endReason string // why the session ended, first one wins
}

// end ends the session with cause (what the daemon is told) and records
// reason for node.disconnected, unless it is ending already.
func (c *conn) end(reason string, cause error) {
	c.endMu.Lock()
	if c.endReason == "" {
		c.endReason = reason
	}
	c.endMu.Unlock()
	c.cancel(cause)
}

func (c *conn) reason() string {
	c.endMu.Lock()
	defer c.endMu.Unlock()
	return c.endReason
}

func (c *conn) kickNow() {
	if c.onKick != nil {
		c.onKick()
		return
	}
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// reasonKindsUnreadable refuses a session whose certificate's allowed kinds
// the server cannot read (a corrupt node_certs.allowed_kinds).
const reasonKindsUnreadable = "allowed-kinds-unreadable"

// allowedKinds reads a certificate's allowed kinds (node_certs.allowed_kinds,
// R7.5). Absent (no bytes, JSON null) and [] are no restriction; a value
// that is not a JSON array of strings is an error. SECURITY: it fails
// closed, as the command queue does on the same column: a corrupt value
// must refuse the session, never lift the certificate's restriction.
func allowedKinds(raw []byte) ([]string, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, nil
	}
	var kinds []string
	if err := json.Unmarshal(raw, &kinds); err != nil {
		return nil, fmt.Errorf("read allowed kinds: %w", err)
	}
	return kinds, nil
}

// auth is an authenticated session's certificate and node.
type auth struct {
	node store.Node
	cert store.NodeCert
}

// refusal is a refused session with what its event needs.
type refusal struct {
	reason, tenantID, nodeID, serial, peer string
}

func (r *refusal) Error() string { return "session refused: " + r.reason }

// Connect serves one session stream on connect-go (the agent listener on
// net/http, and an in-process gateway). callbacks.go serves the same
// session on h2server's callbacks; both run the steps below.
func (s *Service) Connect(ctx context.Context, stream *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) error {
	procedure := agentv1connect.SessionServiceConnectProcedure
	if !s.enter() {
		return wire.ToWire(s.log, procedure, errShutdown)
	}
	defer s.leave()
	peer := stream.RequestHeader().Get(wire.PeerAddrHeader)
	der := wire.PeerCertificate(stream.RequestHeader())
	a, err := s.authenticate(ctx, der)
	if err != nil {
		if s.retiredWithProof(ctx, stream, der) {
			// Recorded like any refusal; only the answer differs.
			_ = s.fail(ctx, procedure, peer, err)
			return wire.ToWire(s.log, procedure, wire.ErrNodeRetired())
		}
		return s.fail(ctx, procedure, peer, err)
	}
	nonce, err := s.challenge(stream.Send)
	if err != nil {
		return nil // the daemon left
	}
	hello, err := s.receiveHello(ctx, stream)
	if err != nil {
		return s.fail(ctx, procedure, peer, helloRefused(a, err))
	}
	c, apiKey, err := s.admit(a, der, nonce, hello)
	if err != nil {
		return s.fail(ctx, procedure, peer, err)
	}
	c.kick = make(chan struct{}, 1)
	if err := s.connected(ctx, c, a, hello, peer); err != nil {
		return s.fail(ctx, procedure, peer, err)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	c.cancel = cancel
	s.register(c)
	defer s.finish(ctx, c)

	if err := stream.Send(s.welcome(c, apiKey)); err != nil {
		c.end(endClosed, nil)
		return nil
	}
	s.cfg.Metrics.SessionOpened()
	msgs := make(chan *agentv1.SessionClientMessage, 8)
	recvErr := make(chan error, 1)
	s.goRead(ctx, func() {
		for {
			m, err := stream.Receive()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case msgs <- m:
			case <-ctx.Done():
				return
			}
		}
	})
	c.kickNow() // deliver what was queued while the node was away
	for {
		select {
		case <-ctx.Done():
			return s.over(ctx, c, procedure)
		case <-recvErr:
			c.end(endClosed, nil)
			return nil
		case m := <-msgs:
			// Only what the node key signed (handle) counts as the node
			// being there: a relay cannot keep the session alive.
			if err := s.handle(ctx, c, m); err != nil {
				return s.handleErr(ctx, c, procedure, peer, err)
			}
		case <-c.kick:
			s.deliverNow(ctx, c, stream.Send)
		}
	}
}

// helloRefused names the authenticated node and certificate in a refusal
// of Hello (receiveHello's refusals know neither).
func helloRefused(a *auth, err error) error {
	var r *refusal
	if errors.As(err, &r) {
		r.tenantID, r.nodeID, r.serial = a.node.TenantID, a.node.ID, a.cert.Serial
	}
	return err
}

// admit checks Hello's proof of possession (and agrees the heartbeat key
// when the daemon offered one) and the certificate's allowed kinds, and
// returns the session, not yet connected, with the API's heartbeat key
// for Welcome (nil when none was agreed), or a refusal.
func (s *Service) admit(a *auth, der, nonce []byte, hello *agentv1.Hello) (*conn, []byte, error) {
	leaf, reason := checkProof(der, a.node.ID, nonce, hello)
	var mac *pki.HeartbeatMAC
	var apiKey []byte
	if reason == "" && s.cfg.HeartbeatMAC {
		mac, apiKey, reason = agreeHeartbeatKey(der, a.node.ID, nonce, hello)
	}
	if reason != "" {
		return nil, nil, &refusal{reason: reason, tenantID: a.node.TenantID, nodeID: a.node.ID, serial: a.cert.Serial}
	}
	kinds, err := allowedKinds(a.cert.AllowedKinds)
	if err != nil {
		return nil, nil, &refusal{reason: reasonKindsUnreadable, tenantID: a.node.TenantID, nodeID: a.node.ID, serial: a.cert.Serial}
	}
	// The issuer's names are copied: the parsed certificate's slices
	// would keep its whole DER for as long as the session is held.
	c := &conn{id: newSessionID(), nodeID: a.node.ID, tenantID: a.node.TenantID, siteID: a.node.SiteID, role: a.cert.Role, generation: a.node.IdentityGeneration, serial: a.cert.Serial,
		nodeKey: leaf.PublicKey, issuerKeyID: bytes.Clone(leaf.AuthorityKeyId), issuer: bytes.Clone(leaf.RawIssuer), nonce: nonce, notAfter: a.cert.NotAfter, allowedKinds: kinds, mac: mac, sent: map[string]struct{}{}}
	now := s.cfg.Clock.Now()
	c.lastRecv.Store(now.UnixMilli())
	c.lastTouch = now
	return c, apiKey, nil
}

// over is how a held session whose context ended answers: the cause it
// was ended with, or nothing when the daemon (or its stream) ended it.
func (s *Service) over(ctx context.Context, c *conn, procedure string) error {
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return wire.ToWire(s.log, procedure, cause)
	}
	c.end(endClosed, nil)
	return nil
}

// handleErr ends a held session after handle failed: a refusal is
// recorded and answered with the uniform refusal; another error ends it
// as such.
func (s *Service) handleErr(ctx context.Context, c *conn, procedure, peer string, err error) error {
	var r *refusal
	if errors.As(err, &r) {
		c.end(r.reason, errRefused)
		return s.fail(ctx, procedure, peer, err)
	}
	c.end(endError, err)
	return wire.ToWire(s.log, procedure, err)
}

// deliverNow delivers the node's queued commands with send, logging a
// failure unless the session is ending (its end says how).
func (s *Service) deliverNow(ctx context.Context, c *conn, send func(*agentv1.SessionServerMessage) error) {
	if err := s.deliver(ctx, c, send); err != nil && ctx.Err() == nil {
		s.log.Warn("deliver commands", telemetry.LogNodeID, c.nodeID, "err", err)
	}
}

// welcome is the session's Welcome, with the API's heartbeat key when the
// session agreed one (apiKey, else nil).
func (s *Service) welcome(c *conn, apiKey []byte) *agentv1.SessionServerMessage {
	return &agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Welcome{Welcome: &agentv1.Welcome{
		NodeId: c.nodeID, HeartbeatSeconds: int32(s.cfg.Heartbeat / time.Second),
		// R7.5: the gateway checks each command's kind again at dispatch
		// against the kinds of the certificate this session authenticated
		// with (empty: no restriction).
		AllowedKinds: c.allowedKinds, KeyStatements: s.keyStatements(),
		// R19.3: bcd dates what it stamps by the API's clock.
		ServerTimeUnixMs: s.cfg.Clock.Now().UnixMilli(),
		HeartbeatKey:     apiKey}}}
}

func newSessionID() string {
	b := make([]byte, 12)
	_, _ = rand.Read(b)
	return "sess_" + hex.EncodeToString(b)
}

// authenticate checks the presented certificate (R12.1) through the
// identity core's one check (ForSession).
func (s *Service) authenticate(ctx context.Context, der []byte) (*auth, error) {
	var a auth
	err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		c, err := s.cfg.Core.Check(ctx, tx, nodeident.Presented{DER: der}, nodeident.ForSession)
		var r *nodeident.Refusal
		if errors.As(err, &r) {
			return &refusal{reason: r.Reason, tenantID: r.TenantID, nodeID: r.NodeID, serial: r.Serial}
		} else if err != nil {
			return err
		}
		a = auth{node: c.Node, cert: c.Row}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return &a, nil
}

// receiveHello reads the first message, which must be Hello.
func (s *Service) receiveHello(ctx context.Context, stream *connect.BidiStream[agentv1.SessionClientMessage, agentv1.SessionServerMessage]) (*agentv1.Hello, error) {
	type got struct {
		m   *agentv1.SessionClientMessage
		err error
	}
	ch := make(chan got, 1)
	s.goRead(ctx, func() {
		m, err := stream.Receive()
		ch <- got{m, err}
	})
	t := s.cfg.Clock.NewTimer(helloTimeout)
	defer t.Stop()
	select {
	case g := <-ch:
		if g.err != nil {
			return nil, &refusal{reason: "hello-missing"}
		}
		if h := g.m.GetHello(); h != nil {
			return h, nil
		}
		return nil, &refusal{reason: "hello-missing"}
	case <-t.C():
		return nil, &refusal{reason: "hello-timeout"}
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// connected marks the node connected, puts back in the queue the
// commands earlier sessions sent without an answer, publishes
// node.connected and, on the first Hello of an adopting node whose pool has
// acceptance checks, queues acceptance (R4.5, R12.2), all in one
// transaction.
func (s *Service) connected(ctx context.Context, c *conn, a *auth, hello *agentv1.Hello, peer string) error {
	return s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		n, err := tx.GetNode(ctx, c.nodeID)
		if err != nil {
			return err
		}
		// The node may have moved since authenticate read it.
		if n.State == store.NodeRetired || n.IdentityGeneration != c.generation {
			return &refusal{reason: "node-changed", tenantID: n.TenantID, nodeID: n.ID, serial: a.cert.Serial}
		}
		if _, err := tx.ConnectNode(ctx, n.ID, c.id); err != nil {
			return err
		}
		if err := ackPins(ctx, tx, c, hello); err != nil {
			return err
		}
		// A command an earlier session sent stays sent when that
		// session's replica died before finish could put it back. This
		// session delivers it again (after its Welcome): bcd answers an id
		// it already ran with "replayed" and never runs it twice. A live
		// older session elsewhere is superseded by ConnectNode; a command
		// it sends meanwhile goes back when it ends.
		requeued, err := tx.RequeueSentCommands(ctx, n.ID)
		if err != nil {
			return err
		}
		accept := false
		if n.State == store.NodeAdopting {
			pool, err := tx.GetPool(ctx, n.PoolID)
			if err != nil {
				return err
			}
			policy, err := tenancy.ParsePolicy(pool.Policy)
			if err != nil {
				return err
			}
			if policy.Acceptance != nil {
				if accept, err = tx.EnqueueWorkOnce(ctx, WorkAccept, n.ID); err != nil {
					return err
				}
			}
		}
		data := map[string]any{
			"nodeId": n.ID, "sessionId": c.id, "certSerial": a.cert.Serial, "identityGeneration": n.IdentityGeneration, "protocol": hello.GetProtocol(),
			"bcdVersion": truncate(hello.GetBcdVersion(), 64), "peer": peer, "acceptanceQueued": accept,
		}
		if requeued > 0 {
			data["commandsRequeued"] = requeued
		}
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: n.TenantID, Type: "node.connected", Subject: n.ID, Data: data}); err != nil {
			return err
		}
		// R14.2: the node (proven by its key) connected.
		return events.Audit(ctx, tx, events.Entry{TenantID: n.TenantID, Actor: "node:" + n.ID, Action: "node.connected", Resource: nodeResource(n.ID), Data: data})
	})
}

// ackPins records the pins Hello says the daemon holds (R21.2), when the
// node key signed them over this session's nonce. Unsigned, badly signed
// or malformed pins are not recorded and refuse nothing: pki status then
// keeps counting the node as behind, the safe side, whatever a relay did.
func ackPins(ctx context.Context, tx *store.Tx, c *conn, hello *agentv1.Hello) error {
	if pki.VerifyPinsAck(c.nodeKey, c.nonce, hello.GetPins(), hello.GetPinsSig()) != nil {
		return nil
	}
	return tx.AckNodePins(ctx, c.nodeID, hello.GetPins())
}

// nodeResource names a node in audit rows.
func nodeResource(id string) string { return "compute-node/" + id }

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// register makes c the node's session on this replica, ending an older one.
func (s *Service) register(c *conn) {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		c.end(endShutdown, errShutdown)
		return
	}
	old := s.sessions[c.nodeID]
	s.sessions[c.nodeID] = c
	s.held.regSeq++
	c.regSeq = s.held.regSeq
	s.held.registered = append(s.held.registered, c) // its first Check reads its state (held.go)
	if !s.polling {
		s.polling = true
		s.pollDone = make(chan struct{})
		go s.poll(s.pollDone) // Close waits for it
	}
	s.mu.Unlock()
	if old != nil {
		old.end(endReplaced, errReplaced)
	}
}

// finish unregisters c, puts the commands it sent without an answer back
// in the queue, and marks the node disconnected unless a newer session
// took over, with node.disconnected and its audit row naming why the
// session ended, all in one transaction.
func (s *Service) finish(ctx context.Context, c *conn) {
	s.mu.Lock()
	if s.sessions[c.nodeID] == c {
		delete(s.sessions, c.nodeID)
	}
	s.mu.Unlock()
	ctx = context.WithoutCancel(ctx)
	reason := c.reason()
	if reason == "" {
		reason = endClosed
	}
	unanswered := make([]string, 0, len(c.sent))
	for id := range c.sent {
		unanswered = append(unanswered, id)
	}
	sort.Strings(unanswered)
	err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		if len(unanswered) > 0 {
			n, err := tx.RequeueCommands(ctx, c.nodeID, unanswered)
			if err != nil {
				return err
			}
			if n > 0 {
				tx.AfterCommit(func() { s.Notify(c.nodeID) })
			}
		}
		ok, err := tx.DisconnectNode(ctx, c.nodeID, c.id)
		if err != nil || !ok {
			return err
		}
		data := map[string]any{"nodeId": c.nodeID, "sessionId": c.id, "certSerial": c.serial, "reason": reason}
		if err := events.Publish(ctx, tx, s.cfg.Hub, events.Event{TenantID: c.tenantID, Type: "node.disconnected", Subject: c.nodeID, Data: data}); err != nil {
			return err
		}
		// R14.2: the node left (closed), or the control plane ended its
		// session (retired, reclaimed, revoked, idle, ...).
		actor := "system"
		if reason == endClosed {
			actor = "node:" + c.nodeID
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: c.tenantID, Actor: actor, Action: "node.disconnected", Resource: nodeResource(c.nodeID), Data: data})
	})
	if err != nil {
		s.log.Error("mark node disconnected", telemetry.LogNodeID, c.nodeID, "err", err)
	}
}

// handle processes one client message after Hello.
func (s *Service) handle(ctx context.Context, c *conn, m *agentv1.SessionClientMessage) error {
	switch {
	case m.GetHeartbeat() != nil:
		due, err := s.beat(c, m.GetHeartbeat())
		if err != nil {
			return err
		}
		if due {
			s.touch(ctx, c)
		}
	case m.GetResult() != nil:
		return s.result(ctx, c, m.GetResult())
	case m.GetSiteReport() != nil:
		return s.siteReport(ctx, c, m.GetSiteReport())
	case m.GetHello() != nil:
		return errs.New(errs.InvalidArgument, "Hello comes once, first")
	}
	return nil
}

// beat checks a heartbeat and notes that the node is there; it reports
// whether the heartbeat is due to be recorded (touch, every TouchEvery),
// or returns a refusal. It writes nothing.
func (s *Service) beat(c *conn, hb *agentv1.Heartbeat) (bool, error) {
	if reason := checkHeartbeat(c, hb); reason != "" {
		return false, &refusal{reason: reason, tenantID: c.tenantID, nodeID: c.nodeID, serial: c.serial}
	}
	s.cfg.Metrics.Heartbeat()
	now := s.cfg.Clock.Now()
	c.lastRecv.Store(now.UnixMilli())
	if now.Sub(c.lastTouch) < s.cfg.TouchEvery {
		return false, nil
	}
	c.lastTouch = now
	return true, nil
}

// result finishes a command with the node's answer and wakes the node's
// work. An answer whose signature does not verify under the session's
// certificate is not stored, and ends the session (a refusal with reason
// result-signature); answers for unknown commands, or another node's, are
// dropped.
func (s *Service) result(ctx context.Context, c *conn, r *agentv1.CommandResult) error {
	var done, forged bool
	var cmd store.Command
	err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
		done, forged = false, false
		var err error
		cmd, err = tx.GetCommand(ctx, r.GetCommandId())
		if errors.Is(err, store.ErrNotFound) || err == nil && cmd.NodeID != c.nodeID {
			// SECURITY: a node finishes only its own commands.
			return nil
		} else if err != nil {
			return err
		}
		if reason := checkResult(c, cmd, r); reason != "" {
			forged = true
			return nil
		}
		out := r.GetOutput()
		errText := truncate(r.GetError(), 1024)
		if len(out) > maxResultBytes || len(out) > 0 && !json.Valid(out) {
			out, errText = nil, strings.TrimSpace(errText+" (output dropped: not JSON or too large)")
		}
		state := store.CommandDone
		if !r.GetOk() {
			state = store.CommandFailed
		}
		if done, err = tx.FinishCommand(ctx, cmd.ID, state, out, errText); err != nil || !done {
			return err
		}
		sum := sha256.Sum256(r.GetOutput())
		actor := "node:" + c.nodeID
		if len(r.GetSig()) == 0 {
			actor = "gateway" // its refusal of a kind (checkResult)
		}
		// R14.2: who answered, what, on which node.
		if err := events.Audit(ctx, tx, events.Entry{TenantID: c.tenantID, Actor: actor, Action: "command." + state, Resource: nodeResource(c.nodeID),
			Data: map[string]any{"commandId": cmd.ID, "nodeId": c.nodeID, "kind": cmd.Kind, "identityGeneration": cmd.IdentityGeneration,
				"sessionId": c.id, "ok": r.GetOk(), "error": errText, "outputSha256": hex.EncodeToString(sum[:])}}); err != nil {
			return err
		}
		return tx.WakeNodeWork(ctx, c.nodeID)
	})
	if err != nil {
		s.log.Error("record command result", telemetry.LogNodeID, c.nodeID, "command", r.GetCommandId(), "err", err)
		return nil
	}
	if forged {
		s.log.Warn("command result refused: its signature does not verify under the session's certificate",
			"node", c.nodeID, "command", cmd.ID, "session", c.id)
		return &refusal{reason: reasonResultSignature, tenantID: c.tenantID, nodeID: c.nodeID, serial: c.serial}
	}
	delete(c.sent, cmd.ID)
	if done {
		s.cfg.Metrics.Command(telemetry.CommandAnswered, 1)
	}
	if cmd.ID != "" {
		c.lastRecv.Store(s.cfg.Clock.Now().UnixMilli()) // a verified answer: the node is there
	}
	if done {
		s.mu.Lock()
		fn := s.onResult
		s.mu.Unlock()
		if fn != nil {
			fn()
		}
	}
	return nil
}

// keyStatements returns the rotation statements the daemon learns from
// its Welcome (R16.2).
func (s *Service) keyStatements() []string {
	if b := s.cfg.Bundle.Now(); b != nil {
		return b.KeyStatements
	}
	return nil
}

// deliver signs the node's queued commands and sends them with send.
func (s *Service) deliver(ctx context.Context, c *conn, send func(*agentv1.SessionServerMessage) error) error {
	if s.cfg.Bundle == nil || s.cfg.Bundle.CommandSigningKey == nil {
		return nil
	}
	var cmds []store.Command
	if err := s.cfg.DB.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		cmds, err = tx.QueuedCommands(ctx, c.nodeID, 16)
		return err
	}); err != nil {
		return err
	}
	now := s.cfg.Clock.Now()
	for _, cmd := range cmds {
		finish := func(state, why string) error {
			return s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
				done, err := tx.FinishCommand(ctx, cmd.ID, state, nil, why)
				if err != nil || !done {
					return err
				}
				if err := events.Audit(ctx, tx, events.Entry{TenantID: c.tenantID, Actor: "system", Action: "command." + state, Resource: nodeResource(c.nodeID),
					Data: map[string]any{"commandId": cmd.ID, "nodeId": c.nodeID, "kind": cmd.Kind, "identityGeneration": cmd.IdentityGeneration, "error": why}}); err != nil {
					return err
				}
				return tx.WakeNodeWork(ctx, c.nodeID)
			})
		}
		switch {
		case cmd.IdentityGeneration != c.generation:
			if err := finish(store.CommandExpired, "issued for another identity generation"); err != nil {
				return err
			}
			continue
		case !now.Before(cmd.ExpiresAt):
			if err := finish(store.CommandExpired, "expired before delivery"); err != nil {
				return err
			}
			continue
		case !wire.KindAllowed(c.allowedKinds, cmd.Kind):
			// R7.5: checked again at dispatch.
			if err := finish(store.CommandFailed, "kind not allowed by the node certificate"); err != nil {
				return err
			}
			continue
		}
		// R12.3: the body names the node, its identity generation and the
		// command's unique id; bcd refuses another generation's and an id
		// it already ran.
		body, err := proto.MarshalOptions{Deterministic: true}.Marshal(&agentv1.CommandBody{
			CommandId: cmd.ID, NodeId: cmd.NodeID, IdentityGeneration: int64(cmd.IdentityGeneration), Kind: cmd.Kind, Args: cmd.Args,
			IssuedAtUnixMs: now.UnixMilli(), ExpiresAtUnixMs: cmd.ExpiresAt.UnixMilli(),
		})
		if err != nil {
			return fmt.Errorf("marshal command: %w", err)
		}
		sig, err := pki.SignPurpose(s.cfg.Bundle.Now().CommandSigningKey, pki.PurposeCommand, body)
		if err != nil {
			return err
		}
		var sent bool
		if err := s.cfg.DB.WithTx(ctx, func(tx *store.Tx) error {
			var err error
			sent, err = tx.MarkCommandSent(ctx, cmd.ID)
			return err
		}); err != nil {
			return err
		}
		if !sent {
			continue
		}
		if err := send(&agentv1.SessionServerMessage{Msg: &agentv1.SessionServerMessage_Command{Command: &agentv1.SignedCommand{Body: body, Sig: sig}}}); err != nil {
			// Not delivered (as far as this side knows): back to the
			// queue for the next session.
			c.sent[cmd.ID] = struct{}{}
			return fmt.Errorf("send command: %w", err)
		}
		s.cfg.Metrics.Command(telemetry.CommandDelivered, 1)
		if len(c.sent) < maxUnanswered {
			c.sent[cmd.ID] = struct{}{}
		}
	}
	return nil
}

// poll runs while this replica holds sessions: every Check it ends idle
// sessions, those whose certificate expired, and those the database says
// are over (checkHeld); every Poll it kicks the sessions of nodes with
// queued commands (written by a controller on another replica, or missed).
// It returns when no session is held or Close stops it, and closes done.
func (s *Service) poll(done chan struct{}) {
	defer close(done)
	t := s.cfg.Clock.NewTicker(s.cfg.Check)
	defer t.Stop()
	lastScan := s.cfg.Clock.Now()
	for {
		select {
		case <-t.C():
		case <-s.stopPoll:
			s.mu.Lock()
			s.polling = false
			s.mu.Unlock()
			return
		}
		if !s.checkHeld(context.Background()) {
			return
		}
		now := s.cfg.Clock.Now()
		if now.Sub(lastScan) < s.cfg.Poll {
			continue
		}
		lastScan = now
		var nodes []string
		err := s.cfg.DB.ReadTx(context.Background(), func(tx *store.Tx) error {
			var err error
			nodes, err = tx.NodesWithQueuedCommands(context.Background(), 10000)
			return err
		})
		if err != nil {
			s.log.Warn("poll queued commands", "err", err)
			continue
		}
		for _, id := range nodes {
			s.Notify(id)
		}
	}
}

// fail records a refusal, or maps another error, and returns the wire
// error.
func (s *Service) fail(ctx context.Context, procedure, peer string, err error) error {
	var r *refusal
	if !errors.As(err, &r) {
		if ctx.Err() != nil {
			return wire.ToWire(s.log, procedure, errs.New(errs.Unavailable, "the session ended"))
		}
		return wire.ToWire(s.log, procedure, err)
	}
	r.peer = peer
	s.refused(ctx, r)
	return wire.ToWire(s.log, procedure, errRefused)
}

// refused records a refusal as a security.session.refused event through
// the identity core: to the node's owner once the caller proved the
// certificate's key, else to the root tenant.
func (s *Service) refused(ctx context.Context, r *refusal) {
	s.cfg.Core.Refused(ctx, nodeident.Refused{Kind: nodeident.KindSession,
		Refusal: &nodeident.Refusal{Reason: r.reason, TenantID: r.tenantID, NodeID: r.nodeID, Serial: r.serial},
		Data:    map[string]any{"peer": r.peer}, Peer: r.peer})
}
