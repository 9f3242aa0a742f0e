package gateway

import (
	"context"
	"errors"
	"log/slog"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/gen/bettercompute/agent/v1/agentv1connect"
	"github.com/better-compute/better-compute/internal/shared/clock"
)

// Hedging (R19.2). A join or renewal goes to one replica and is sent
// again, the very same bytes, to the next healthy replica when
//   - the attempt fails without an answer (the connection was refused or
//     reset, the stream broke), or its replica answers UNAVAILABLE (its
//     database is out);
//   - its replica is taken out while the attempt is in flight (a failed
//     health check or call elsewhere; within a second of a stall);
//   - the attempt has no answer after attempt_timeout.
// Earlier attempts keep running: the first answer that settles the call
// wins, and when relayUnary returns the others are cancelled and their
// late answers dropped. A session stream is never resent (session.go): it
// is not a call that can be repeated, and bcd reconnects on its own.
//
// Why resending is safe:
//   - A join request that arrives again gets the answer stored for it and
//     spends nothing (R4.9), also while the first copy is still being
//     decided (the loser of that race gets the stored answer). However many
//     replicas see it, one node is made and one use spent, and every
//     answer is the same, so the first answer wins, a refusal included.
//   - A renewal is not idempotent that way: the API remembers its proof
//     and refuses it a second time (proof-replayed), and the copy that
//     commits first supersedes the certificate it presents. So a renewed
//     certificate wins at once, but a refusal is passed on only when no
//     other attempt may have reached its replica; otherwise it is held (it
//     may be the echo of the other attempt's success) and, if no success
//     comes, bcd gets UNAVAILABLE, what it would have got without the
//     resend. A resend never makes a renewal's outcome worse, and when the
//     stalled replica had not committed it, the healthy one answers.

// errOutcomeUnknown ends a renewal whose copies were refused while one of
// them may have landed; the daemon sees UNAVAILABLE and retries.
var errOutcomeUnknown = errors.New("a resent renewal was refused while an earlier copy may have landed: outcome unknown")

// attempt is one replica's outcome of a relayed call.
type attempt[Res any] struct {
	u   *upstream
	res *connect.Response[Res]
	err error
}

// hedge is one relayed call over its attempts.
type hedge[Res any] struct {
	g         *Gateway
	procedure string
	// send starts an attempt on a replica; its outcome arrives on results.
	send    func(*upstream)
	results chan attempt[Res]
	tried   []*upstream
	running int
	// out is closed when the newest attempt's replica is taken out.
	out <-chan struct{}
	// held is a renewal's first refusal; mayHaveLanded says an attempt
	// ended without telling whether it committed.
	held          error
	mayHaveLanded bool
	last          error
}

func newHedge[Res any](g *Gateway, procedure string) *hedge[Res] {
	return &hedge[Res]{g: g, procedure: procedure, results: make(chan attempt[Res], len(g.ups))}
}

// run relays the call until an answer settles it or every attempt ended;
// ctx bounds the whole call (request_timeout).
func (h *hedge[Res]) run(ctx context.Context) (*connect.Response[Res], error) {
	timer := h.g.clock.NewTimer(h.g.cfg.AttemptTimeout)
	defer timer.Stop()
	h.next(ctx, timer)
	for h.running > 0 {
		select {
		case a := <-h.results:
			h.running--
			if res, err, done := h.settle(ctx, a); done {
				return res, err
			}
			if a.u == h.tried[len(h.tried)-1] {
				h.next(ctx, timer) // the newest attempt failed: move on at once
			}
		case <-timer.C():
			h.next(ctx, timer)
		case <-h.out:
			h.out = nil
			h.next(ctx, timer)
		}
	}
	switch {
	case h.held != nil && !h.mayHaveLanded:
		return nil, h.held
	case h.held != nil:
		return nil, errOutcomeUnknown
	}
	return nil, h.last
}

// next sends the call to the next replica, if there is one, the call is
// not over and no refusal is held.
func (h *hedge[Res]) next(ctx context.Context, timer clock.Timer) {
	if ctx.Err() != nil || h.held != nil {
		return
	}
	u := h.g.pick(h.tried)
	if u == nil {
		h.out = nil
		return
	}
	if len(h.tried) > 0 {
		prev := h.tried[len(h.tried)-1]
		h.g.lines.LogContext(ctx, slog.LevelInfo, "retried\x1f"+h.procedure, "relay resent to another API replica", "procedure", h.procedure,
			"from", prev.base, "to", u.base, "attempts_running", h.running)
	}
	h.tried = append(h.tried, u)
	h.running++
	h.out = u.outSignal()
	timer.Reset(h.g.cfg.AttemptTimeout)
	h.send(u)
}

// settle reads one attempt's outcome and reports whether it decides the
// call (with what to answer).
func (h *hedge[Res]) settle(ctx context.Context, a attempt[Res]) (*connect.Response[Res], error, bool) {
	if a.err == nil {
		return a.res, nil, true
	}
	h.last = a.err
	var ce *connect.Error
	answered := errors.As(a.err, &ce) && connect.IsWireError(ce)
	switch {
	case !answered:
		if ctx.Err() == nil && !errors.Is(a.err, errStopped) {
			h.g.relayError(a.u)
			h.g.markDown(a.u, a.err)
		}
		if !notSent(a.err) {
			h.mayHaveLanded = true
		}
	case ce.Code() == connect.CodeUnavailable:
		// Its database is out, or did not confirm a commit.
		h.mayHaveLanded = true
	case h.procedure == agentv1connect.JoinServiceJoinProcedure:
		return nil, a.err, true // the API's word on this join, the same on every replica
	case h.held == nil:
		h.held = a.err
	}
	if h.held != nil && h.running == 0 && !h.mayHaveLanded {
		return nil, h.held, true
	}
	return nil, nil, false
}
