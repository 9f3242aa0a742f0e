package session

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"

	"connectrpc.com/connect"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/net/http2"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/better-compute/better-compute/gen/bettercompute/agent/v1"
	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/tracing"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// A session on callbacks (the agent listener on h2server, [agent] http2 =
// "framer") runs the steps Connect runs, without a goroutine while it is
// idle: h2server hands over the stream's bytes on its connection's
// goroutine (Data), where grpcmsg cuts them into messages. A heartbeat is
// checked there at once (a MAC, or a signature: no I/O); everything that
// waits on the database or the network (authenticate, connected and
// register, Hello's checks, results, site reports, deliveries, last_seen
// writes, the session's end) is a job for the session's worker, a
// goroutine started when the first job is queued and ending when the
// queue is empty. The worker runs one job at a time, in order, so the
// steps see the session as Connect's one goroutine does.
//
// What ends a held session reaches it as on Connect, through conn.end:
// its cancel here also queues the end, which finishes the session
// (finish), answers with the cause in the gRPC trailers (grpcTrailers)
// and resets the request side if the gateway has not ended it.
//
// Tracing: a session has the server span tracing.Handler gives Connect on
// net/http (the same name and attributes, a child of the gateway's
// traceparent, whose sampled flag stands: its callers are authenticated
// gateways), in the session's context, so its transactions are its
// children; it ends with the session's answer (endStream).
//
// Flow control: a message's bytes go back to the gateway's window once
// its job ran, so what one session queues is bounded by its window
// (h2server's InitialWindowSize), and by maxJobs.

// maxJobs bounds the jobs one session queues: a gateway sending many
// small messages faster than they are handled ends the session as a
// stream that could not be read.
const maxJobs = 1024

// StreamOptions are the limits of sessions served on callbacks, those the
// connect handler is given (connect.WithReadMaxBytes, WithSendMaxBytes;
// zero: none).
type StreamOptions struct {
	ReadMaxBytes, SendMaxBytes int
	// Tracer records each session's server span (the connect handler's
	// tracing.Handler's); nil: the global provider, a no-op unless
	// tracing.Setup ran.
	Tracer trace.TracerProvider
}

// Streams serves SessionService.Connect on h2server's callbacks. Build it
// with Service.Streams.
type Streams struct {
	s    *Service
	opts StreamOptions
}

// Streams returns the callback transport of the service's sessions.
func (s *Service) Streams(opts StreamOptions) *Streams { return &Streams{s: s, opts: opts} }

// Serve serves st when it is a gRPC call of Connect (POST,
// application/grpc or application/grpc+proto, no compression, no
// deadline: what a gateway sends) and returns its handler, or returns nil
// for any other stream: the caller serves it with the connect handler
// (h2server.HTTP), which answers every protocol connect-go does.
func (h *Streams) Serve(st *h2server.Stream) h2server.StreamHandler {
	r := st.Request()
	ct := r.Header.Get("Content-Type")
	switch {
	case r.Path != agentv1connect.SessionServiceConnectProcedure || r.Method != http.MethodPost,
		ct != "application/grpc" && ct != "application/grpc+proto",
		r.Header.Get("Grpc-Encoding") != "" && r.Header.Get("Grpc-Encoding") != "identity",
		r.Header.Get("Grpc-Timeout") != "":
		return nil
	}
	s := h.s
	x := &cbSession{s: s, opts: h.opts, st: st, ctype: ct, peer: r.Header.Get(wire.PeerAddrHeader), der: wire.PeerCertificate(r.Header)}
	x.msgs.Max = h.opts.ReadMaxBytes
	if x.msgs.Max <= 0 {
		x.msgs.Max = 1<<31 - 1
	}
	// The span lives in the session's context, which the session keeps
	// anyway: ctx of a held session's jobs, and endStream's to end it.
	ctx, _ := tracing.StartServer(context.Background(), h.opts.Tracer, r.Method, r.Path, r.Header, tracing.TrustCallerSampling())
	x.ctx, x.cancel = context.WithCancelCause(ctx)
	if !s.enter() {
		x.phase = phaseOver
		x.cancel(nil)
		x.endStream(wire.ToWire(s.log, procedure, errShutdown))
		return x
	}
	x.schedule(job{kind: jobStart})
	return x
}

const procedure = agentv1connect.SessionServiceConnectProcedure

// phase is where a session on callbacks is.
type phase uint8

const (
	phaseAuth    phase = iota // authenticate runs
	phaseHello                // Challenge sent; Hello awaited
	phaseRetired              // a retired node's certificate: Challenge sent, Hello awaited
	phaseHeld                 // Welcome sent
	phaseOver                 // answered (or the stream is gone)
)

// jobKind is what a job does.
type jobKind uint8

const (
	jobStart        jobKind = iota // authenticate and challenge
	jobMsg                         // a message from the daemon
	jobRecvEnd                     // the request ended, or could not be read
	jobHelloTimeout                // helloTimeout passed without Hello
	jobDeliver                     // kicked: deliver queued commands
	jobTouch                       // record the last heartbeat (touch)
	jobRefuse                      // a heartbeat was refused (err)
	jobEnd                         // the session's context ended
)

type job struct {
	kind   jobKind
	m      *agentv1.SessionClientMessage
	window int // the message's bytes of the gateway's window
	err    error
}

// cbSession is one session on callbacks.
type cbSession struct {
	s      *Service
	opts   StreamOptions
	st     *h2server.Stream
	ctype  string
	peer   string
	der    []byte
	ctx    context.Context
	cancel context.CancelCauseFunc

	// msgs cuts the request's DATA (Data's: the connection's goroutine).
	msgs h2server.Messages

	// The worker's own.
	a            *auth
	authErr      error // a retired node's refusal (phaseRetired)
	retiredID    string
	nonce        []byte
	wroteHeaders bool

	// beatMu orders heartbeat checks (Data's, and the worker's for one
	// that arrived before Welcome).
	beatMu sync.Mutex

	mu      sync.Mutex
	phase   phase
	c       *conn // set in phaseHeld
	jobs    []job
	working bool
	// A delivery or a touch queued and not started is not queued again.
	deliverQueued, touchQueued bool
	// recvDone: the request ended or failed; later DATA is dropped.
	recvDone bool
	// beatsQueued counts heartbeats queued for the worker: later ones
	// queue behind them, so they are checked in order.
	beatsQueued int
	timer       clock.Timer
}

// errCompressed is a message flagged compressed on a stream that
// negotiated none (connect-go refuses it as a protocol error).
var errCompressed = errors.New("session: compressed message without compression")

// Data cuts messages out of p: a heartbeat of a held session is checked
// at once, anything else is queued for the worker.
func (x *cbSession) Data(_ *h2server.Stream, p []byte, end bool) {
	x.mu.Lock()
	drop := x.phase == phaseOver || x.recvDone
	x.mu.Unlock()
	if drop {
		x.st.Consumed(len(p))
		return
	}
	held, err := x.msgs.Feed(p, x.message)
	x.st.Consumed(held)
	switch {
	case err != nil:
		x.recvEnd(err)
	case end:
		x.recvEnd(io.EOF)
	}
}

// message handles one message as Feed cuts it.
func (x *cbSession) message(flags byte, msg []byte, window int) error {
	if flags != 0 {
		return errCompressed
	}
	m := new(agentv1.SessionClientMessage)
	if err := proto.Unmarshal(msg, m); err != nil {
		return err
	}
	hb := m.GetHeartbeat()
	x.mu.Lock()
	c, inline := x.c, hb != nil && x.phase == phaseHeld && x.beatsQueued == 0
	full := !inline && len(x.jobs) >= maxJobs
	if hb != nil && !inline && !full {
		x.beatsQueued++
	}
	x.mu.Unlock()
	switch {
	case inline:
		x.beat(c, hb)
		x.st.Consumed(window)
		return nil
	case full:
		return errors.New("session: too many messages queued")
	}
	x.schedule(job{kind: jobMsg, m: m, window: window})
	return nil
}

// beat checks a held session's heartbeat, queueing its last_seen write
// when due and its refusal when it fails.
func (x *cbSession) beat(c *conn, hb *agentv1.Heartbeat) {
	x.beatMu.Lock()
	due, err := x.s.beat(c, hb)
	x.beatMu.Unlock()
	switch {
	case err != nil:
		x.schedule(job{kind: jobRefuse, err: err})
	case due:
		x.schedule(job{kind: jobTouch})
	}
}

// recvEnd queues the end of the request (io.EOF) or its failure.
func (x *cbSession) recvEnd(err error) {
	x.mu.Lock()
	done := x.recvDone
	x.recvDone = true
	x.mu.Unlock()
	if !done {
		x.schedule(job{kind: jobRecvEnd, err: err})
	}
}

// Sent needs nothing: a session queues its few messages at once (Write
// never waits) and MaxQueuedBytes bounds them.
func (x *cbSession) Sent(*h2server.Stream, int) {}

// Closed ends the session when the stream ended before its answer: the
// gateway reset it, or the connection is gone.
func (x *cbSession) Closed(_ *h2server.Stream, _ error) {
	x.mu.Lock()
	over := x.phase == phaseOver
	x.mu.Unlock()
	if over {
		return
	}
	x.cancel(context.Canceled)
	x.schedule(job{kind: jobEnd})
}

// endHeld is a held session's conn.cancel: its context ends with cause,
// and the worker answers.
func (x *cbSession) endHeld(cause error) {
	x.cancel(cause)
	x.schedule(job{kind: jobEnd})
}

// kick is a held session's conn.onKick.
func (x *cbSession) kick() { x.schedule(job{kind: jobDeliver}) }

// schedule queues j and starts the worker unless it runs. Nothing is
// queued once the session answered (a message's window goes back).
func (x *cbSession) schedule(j job) {
	x.mu.Lock()
	switch {
	case x.phase == phaseOver:
		x.mu.Unlock()
		x.st.Consumed(j.window)
		return
	case j.kind == jobDeliver && x.deliverQueued, j.kind == jobTouch && x.touchQueued:
		x.mu.Unlock()
		return
	}
	x.deliverQueued = x.deliverQueued || j.kind == jobDeliver
	x.touchQueued = x.touchQueued || j.kind == jobTouch
	x.jobs = append(x.jobs, j)
	start := !x.working
	x.working = true
	x.mu.Unlock()
	if start {
		// The stream is open (Closed queues the end, which runs before
		// the worker stops), so h2server still waits for what it starts.
		x.st.Go(x.run)
	}
}

// run is the worker: it runs the queued jobs and returns once none is
// left.
func (x *cbSession) run() {
	for {
		x.mu.Lock()
		if len(x.jobs) == 0 {
			x.jobs = nil
			x.working = false
			x.mu.Unlock()
			return
		}
		j := x.jobs[0]
		x.jobs[0] = job{}
		x.jobs = x.jobs[1:]
		switch j.kind {
		case jobDeliver:
			x.deliverQueued = false
		case jobTouch:
			x.touchQueued = false
		}
		ph, c := x.phase, x.c
		x.mu.Unlock()
		switch ph {
		case phaseOver:
		case phaseAuth:
			x.start()
		case phaseHello:
			x.awaitHello(j)
		case phaseRetired:
			x.awaitRetiredHello(j)
		case phaseHeld:
			x.held(c, j)
		}
		if j.kind == jobMsg && j.m.GetHeartbeat() != nil {
			x.mu.Lock()
			x.beatsQueued--
			x.mu.Unlock()
		}
		x.st.Consumed(j.window)
	}
}

// start authenticates the certificate and sends the Challenge (Connect's
// first steps); for a retired node's certificate, the Challenge that lets
// it prove its key and be told so (retiredWithProof).
func (x *cbSession) start() {
	s := x.s
	a, err := s.authenticate(x.ctx, x.der)
	if err != nil {
		if id, ok := s.retiredNode(x.ctx, x.der); ok {
			if nonce, cerr := s.challenge(x.send); cerr == nil {
				x.authErr, x.retiredID, x.nonce = err, id, nonce
				x.setPhase(phaseRetired)
				return
			}
		}
		x.close(s.fail(x.ctx, procedure, x.peer, err))
		return
	}
	nonce, err := s.challenge(x.send)
	if err != nil {
		x.close(nil) // the daemon left
		return
	}
	x.a, x.nonce = a, nonce
	x.setPhase(phaseHello)
}

// setPhase moves to an awaiting phase, arming the Hello timeout.
func (x *cbSession) setPhase(p phase) {
	x.mu.Lock()
	x.phase = p
	x.timer = x.s.cfg.Clock.AfterFunc(helloTimeout, func() { x.schedule(job{kind: jobHelloTimeout}) })
	x.mu.Unlock()
}

// awaitHello takes the first message, which must be Hello (receiveHello),
// and admits the session.
func (x *cbSession) awaitHello(j job) {
	s := x.s
	var err error
	switch {
	case j.kind == jobMsg && j.m.GetHello() != nil:
		x.admit(j.m.GetHello())
		return
	case j.kind == jobMsg, j.kind == jobRecvEnd:
		err = &refusal{reason: "hello-missing"}
	case j.kind == jobHelloTimeout:
		err = &refusal{reason: "hello-timeout"}
	case j.kind == jobEnd:
		err = x.ctx.Err()
	default:
		return
	}
	x.close(s.fail(x.ctx, procedure, x.peer, helloRefused(x.a, err)))
}

// awaitRetiredHello answers a retired node's Hello: told it was retired
// when it proves its key, refused as any other certificate otherwise.
func (x *cbSession) awaitRetiredHello(j job) {
	s := x.s
	switch j.kind {
	case jobMsg, jobRecvEnd, jobHelloTimeout, jobEnd:
	default:
		return
	}
	if h := j.m.GetHello(); j.kind == jobMsg && h != nil {
		if _, reason := checkProof(x.der, x.retiredID, x.nonce, h); reason == "" {
			// Recorded like any refusal; only the answer differs.
			_ = s.fail(x.ctx, procedure, x.peer, x.authErr)
			x.close(wire.ToWire(s.log, procedure, wire.ErrNodeRetired()))
			return
		}
	}
	x.close(s.fail(x.ctx, procedure, x.peer, x.authErr))
}

// admit checks Hello, marks the node connected, registers the session
// and welcomes it (Connect's steps between Hello and its loop).
func (x *cbSession) admit(hello *agentv1.Hello) {
	s := x.s
	x.stopTimer()
	c, apiKey, err := s.admit(x.a, x.der, x.nonce, hello)
	if err != nil {
		x.close(s.fail(x.ctx, procedure, x.peer, err))
		return
	}
	if err := s.connected(x.ctx, c, x.a, hello, x.peer); err != nil {
		x.close(s.fail(x.ctx, procedure, x.peer, err))
		return
	}
	c.cancel, c.onKick = x.endHeld, x.kick
	x.a, x.der, x.nonce = nil, nil, nil // the session holds what it needs
	x.mu.Lock()
	x.c, x.phase = c, phaseHeld
	x.mu.Unlock()
	s.register(c)
	if err := x.send(s.welcome(c, apiKey)); err != nil {
		c.end(endClosed, nil)
		return
	}
	s.cfg.Metrics.SessionOpened()
	c.kickNow() // deliver what was queued while the node was away
}

// held runs one job of a held session (Connect's loop).
func (x *cbSession) held(c *conn, j job) {
	s := x.s
	if x.ctx.Err() != nil {
		// However it ended, the session answers once, with its cause.
		x.closeHeld(c, s.over(x.ctx, c, procedure))
		return
	}
	switch j.kind {
	case jobMsg:
		var err error
		if hb := j.m.GetHeartbeat(); hb != nil {
			x.beat(c, hb)
		} else {
			err = s.handle(x.ctx, c, j.m)
		}
		if err != nil {
			x.closeHeld(c, s.handleErr(x.ctx, c, procedure, x.peer, err))
		}
	case jobRefuse:
		x.closeHeld(c, s.handleErr(x.ctx, c, procedure, x.peer, j.err))
	case jobRecvEnd:
		c.end(endClosed, nil) // queues jobEnd
	case jobDeliver:
		s.deliverNow(x.ctx, c, x.send)
	case jobTouch:
		s.touch(x.ctx, c)
	}
}

// send writes one message (the response's headers first).
func (x *cbSession) send(m *agentv1.SessionServerMessage) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	if limit := x.opts.SendMaxBytes; limit > 0 && len(b) > limit {
		return connect.NewError(connect.CodeResourceExhausted, errors.New("session: message over SendMaxBytes"))
	}
	if err := x.writeHeaders(); err != nil {
		return err
	}
	return x.st.Write(h2server.AppendMessage(make([]byte, 0, 5+len(b)), 0, b))
}

// writeHeaders writes the response's headers once, as connect-go's gRPC
// handler sets them.
func (x *cbSession) writeHeaders() error {
	if x.wroteHeaders {
		return nil
	}
	x.wroteHeaders = true
	return x.st.WriteHeaders(http.StatusOK, http.Header{"Content-Type": {x.ctype}, "Grpc-Accept-Encoding": {""}}, false)
}

// close answers a session that was not held with err (after Connect's
// steps before register).
func (x *cbSession) close(err error) {
	x.over()
	x.s.leave()
	x.endStream(err)
}

// closeHeld ends a held session: finish (the node disconnected, its
// unanswered commands back in the queue), then the answer, in Connect's
// order.
func (x *cbSession) closeHeld(c *conn, err error) {
	x.over()
	x.s.finish(x.ctx, c)
	x.s.leave()
	x.endStream(err)
}

// over marks the session answered: no job runs after this one.
func (x *cbSession) over() {
	x.stopTimer()
	x.mu.Lock()
	x.phase = phaseOver
	x.mu.Unlock()
	x.cancel(nil)
}

func (x *cbSession) stopTimer() {
	x.mu.Lock()
	t := x.timer
	x.timer = nil
	x.mu.Unlock()
	if t != nil {
		t.Stop()
	}
}

// endStream writes err as the call's trailers and resets the request side
// if the gateway has not ended it (as net/http does after a handler
// returned).
// Its server span ends with it.
func (x *cbSession) endStream(err error) {
	if x.writeHeaders() == nil {
		_ = x.st.WriteTrailers(wire.GRPCTrailers(err))
	}
	if !x.st.RequestEnded() {
		x.st.Reset(http2.ErrCodeNo)
	}
	trace.SpanFromContext(x.ctx).End()
}
