package bcdcmd

import (
	"context"
	"crypto/tls"
	"net/http"

	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	tracing "github.com/better-compute/better-compute/internal/shared/tracing/lite"
)

// traced sets up cfg's [tracing] (cfg nil, or no endpoint: off) and
// returns the environment's HTTP client func with a client span per call
// whose context goes to the gateway as traceparent, and the flush to run
// before the command returns.
func (a *app) traced(cfg *bcdconfig.Config) (enroll.HTTPClientFunc, func(), error) {
	var c tracing.Config
	if cfg != nil {
		c = cfg.Tracing
	}
	if c.OTLPEndpoint == "" {
		return a.env.HTTPClient, func() {}, nil
	}
	tp, stop, err := tracing.Setup(c, tracing.ServiceBCD) // bcd's own provider, without the SDK
	if err != nil {
		return nil, nil, err
	}
	base := a.env.HTTPClient
	return func(tc *tls.Config) *http.Client {
		return tracing.Client(tp, base(tc))
	}, func() { _ = stop(context.Background()) }, nil
}
