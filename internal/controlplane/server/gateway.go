package server

import (
	"log/slog"
	"net"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// listenGateway builds the gateway that runs in this process when
// [gateway] listen is set, and its listener: daemons connect to it as to
// better-compute gateway, and it calls the API's agent handler in memory
// (api.Server.LocalAgentHandler), with no agent listener, loopback
// connection or second TLS layer between them. nil when it is not
// configured. serve serves it (Gateway.Serve) and shuts it down first.
func listenGateway(cfg Config, o Options, log *slog.Logger, srv *api.Server) (*gateway.Gateway, net.Listener, error) {
	if !cfg.Gateway.InProcess() {
		return nil, nil, nil
	}
	glog := log.With("process", "gateway")
	g, err := gateway.New(cfg.Gateway.Config, gateway.Options{Log: glog, LocalAPI: srv.LocalAgentHandler(), MetricsReady: o.GatewayMetricsReady})
	if err != nil {
		return nil, nil, err
	}
	ln := o.GatewayListener
	if ln == nil {
		if ln, err = net.Listen("tcp", cfg.Gateway.Listen); err != nil {
			return nil, nil, errs.New(errs.InvalidConfig, "gateway listen %s: %v", cfg.Gateway.Listen, err)
		}
	}
	glog.Info("gateway listening", "addr", ln.Addr().String(), "upstream", gateway.LocalAPIURL)
	if o.GatewayReady != nil {
		o.GatewayReady(ln.Addr().String())
	}
	return g, ln, nil
}
