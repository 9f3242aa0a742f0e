package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/gateway/h2server"
	"github.com/better-compute/better-compute/internal/shared/certfile"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
	"github.com/better-compute/better-compute/internal/shared/tasks"
)

// listeners are serve's servers, each with the listener it serves on, all
// opened before any serves (a listener that cannot open stops Run before
// anything runs).
type listeners struct {
	api   *http.Server
	apiLn net.Listener
	// metrics and agent are nil when not configured.
	metrics, agent     *http.Server
	metricsLn, agentLn net.Listener
	// agentFramer serves the agent listener instead of agent with
	// [agent] http2 = "framer" (agent then serves the HTTP/1.1
	// connections it hands over); nil otherwise.
	agentFramer *agentFramer
	// gw is the in-process gateway ([gateway] listen); nil without one.
	gw   *gateway.Gateway
	gwLn net.Listener
	// calls counts the requests the servers' handlers serve: serve
	// returns, and the store closes, only once they all returned, also
	// those a graceful shutdown ran out of time on.
	calls tasks.Tracker
}

// ErrorLinesPerMinute is how many net/http error lines (TLS handshake
// failures and timeouts, ...) each listener writes per kind per minute.
const ErrorLinesPerMinute = 10

// listen opens every listener Run serves on; on a failure it closes those
// it opened and returns the error.
func listen(cfg Config, o Options, log *slog.Logger, reg *prometheus.Registry, srv *api.Server, handler http.Handler, apiCert *certfile.Pair, bundle *ca.Bundle) (_ *listeners, err error) {
	l := &listeners{}
	defer func() {
		if err != nil {
			l.closeListeners()
		}
	}()
	if l.apiLn, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, errs.Wrap(err, errs.InvalidConfig, "listen %s: %v", cfg.Listen, err)
	}
	// SECURITY: anyone who reaches a listener can make net/http log a
	// line (a failed or timed-out TLS handshake): they are rate-limited
	// per listener and kind, naming the peer and the count suppressed.
	errLog := ratelimit.NewLogger(log, ratelimit.New(o.Clock, ErrorLinesPerMinute, time.Minute))
	l.api = newAPIServer(cfg, l.calls.Handler(handler, "shutting down"), apiCert, errLog)
	if l.metrics, l.metricsLn, err = listenMetrics(cfg, o, log, reg, srv); err != nil {
		return nil, err
	}
	if l.agent, l.agentLn, err = listenAgent(cfg, o, log, srv, bundle, errLog); err != nil {
		return nil, err
	}
	for _, s := range []*http.Server{l.metrics, l.agent} {
		if s != nil {
			s.Handler = l.calls.Handler(s.Handler, "shutting down")
		}
	}
	if l.agent != nil && cfg.Agent.Framer() {
		if l.agentFramer, err = newAgentFramer(l.agent, srv, log); err != nil {
			return nil, err
		}
	}
	if l.gw, l.gwLn, err = listenGateway(cfg, o, log, srv); err != nil {
		return nil, err
	}
	return l, nil
}

// closeListeners closes the listeners opened, when Run stops before it
// serves them.
func (l *listeners) closeListeners() {
	for _, ln := range []net.Listener{l.apiLn, l.metricsLn, l.agentLn, l.gwLn} {
		if ln != nil {
			_ = ln.Close()
		}
	}
}

// serve serves each listener as a task of g until shutdown; a failure
// while serving ends g's context (and so starts the shutdown).
func (l *listeners) serve(g *errgroup.Group) {
	loop := func(name string, serve func() error) {
		g.Go(func() error {
			if err := serve(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serve: %s%w", name, err)
			}
			return nil
		})
	}
	loop("", func() error {
		if l.api.TLSConfig != nil {
			return l.api.ServeTLS(l.apiLn, "", "")
		}
		return l.api.Serve(l.apiLn)
	})
	if l.metrics != nil {
		loop("metrics: ", func() error { return l.metrics.Serve(l.metricsLn) })
	}
	switch {
	case l.agentFramer != nil:
		loop("agent: ", func() error {
			if err := l.agentFramer.h2.Serve(l.agentLn); !errors.Is(err, h2server.ErrServerClosed) {
				return err
			}
			return nil
		})
		// Closing h1 (shutdown) ends it too.
		loop("agent (HTTP/1.1): ", func() error {
			if err := l.agent.Serve(l.agentFramer.h1); !errors.Is(err, net.ErrClosed) {
				return err
			}
			return nil
		})
	case l.agent != nil:
		loop("agent: ", func() error { return l.agent.ServeTLS(l.agentLn, "", "") })
	}
	if l.gw != nil {
		loop("gateway: ", func() error { return l.gw.Serve(l.gwLn) })
	}
}

// shutdown stops the servers gracefully within ctx, in order: the
// in-process gateway first (it ends the sessions it relays, whose daemons
// reconnect, and finishes its joins and renewals while the API still
// answers them; it returns once every goroutine it started ended), then
// metrics, the sessions (told UNAVAILABLE; each writes its disconnect
// before the store closes) and the agent listener, and the API last. Once ctx
// ended the servers are closed; either way it returns only once every
// handler returned.
func (l *listeners) shutdown(ctx context.Context, srv *api.Server) error {
	if l.gw != nil {
		_ = l.gw.Shutdown(ctx)
	}
	if l.metrics != nil {
		_ = l.metrics.Shutdown(ctx)
	}
	// Also when the in-process gateway relayed them all: it refuses new
	// ones and stops their checks.
	_ = srv.Sessions().Close(ctx)
	if l.agentFramer != nil {
		// h1 first: h2 waits for a connection it is handing over. Its
		// Shutdown closes what is left once ctx ended.
		_ = l.agentFramer.h1.Close()
		_ = l.agentFramer.h2.Shutdown(ctx)
	}
	if l.agent != nil {
		_ = l.agent.Shutdown(ctx)
	}
	err := l.api.Shutdown(ctx)
	if ctx.Err() != nil {
		// The grace is over: the calls still in flight end now (their
		// contexts end with their connections).
		for _, s := range []*http.Server{l.metrics, l.agent, l.api} {
			if s != nil {
				_ = s.Close()
			}
		}
	}
	l.calls.Close()
	return err
}
