package server

import (
	"context"
	"fmt"
	"log/slog"
	"net"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// serveGateway runs the gateway in this process when [gateway] listen is
// set: daemons connect to it as to better-compute gateway, and it calls the
// API's agent handler in memory (api.Server.LocalAgentHandler), with no
// agent listener, loopback connection or second TLS layer between them.
// nil when it is not configured. A failure while serving goes to errc.
func serveGateway(cfg Config, o Options, log *slog.Logger, srv *api.Server, errc chan<- error) (*gateway.Gateway, error) {
	if !cfg.Gateway.InProcess() {
		return nil, nil
	}
	glog := log.With("process", "gateway")
	g, err := gateway.New(cfg.Gateway.Config, gateway.Options{Log: glog, LocalAPI: srv.LocalAgentHandler(), MetricsReady: o.GatewayMetricsReady})
	if err != nil {
		return nil, err
	}
	ln := o.GatewayListener
	if ln == nil {
		if ln, err = net.Listen("tcp", cfg.Gateway.Listen); err != nil {
			return nil, errs.New(errs.InvalidConfig, "gateway listen %s: %v", cfg.Gateway.Listen, err)
		}
	}
	go func() {
		if err := g.Serve(ln); err != nil {
			errc <- fmt.Errorf("gateway: %w", err)
		}
	}()
	glog.Info("gateway listening", "addr", ln.Addr().String(), "upstream", gateway.LocalAPIURL)
	if o.GatewayReady != nil {
		o.GatewayReady(ln.Addr().String())
	}
	return g, nil
}

// stopGateway ends the in-process gateway's sessions and waits for its
// joins and renewals in flight until ctx ends; nothing without one.
func stopGateway(ctx context.Context, g *gateway.Gateway) {
	if g != nil {
		_ = g.Shutdown(ctx)
	}
}
