package cli

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/gateway"
	"github.com/better-compute/better-compute/internal/shared/tracing"
)

func (a *app) gatewayCmd() *cobra.Command {
	var path string
	var printConfig bool
	cmd := &cobra.Command{
		Use:   "gateway --config FILE",
		Short: "Run a regional gateway that daemons connect to",
		Long: `Run the regional gateway: it terminates the daemons' TLS with the
certificate from 'pki issue-gateway' and relays joins to the API's agent
listener over mTLS with the same certificate. It cannot read join tokens
(they are sealed to JoinService) or mint certificates.

Config (TOML, unknown keys are errors):

  listen       = ":443"
  cert_file    = "/etc/better-compute/gateway.crt"
  key_file     = "/etc/better-compute/gateway.key"
  api_url      = "https://api.internal:8444"     # the API's [agent] listener
  # api_urls   = ["https://api-1.internal:8444", "https://api-2.internal:8444"]
  api_ca_file  = "/etc/better-compute/serving-ca.crt"
  max_body_bytes = 65536
  request_timeout = "30s"
  attempt_timeout = "5s"
  max_concurrent = 1024

  [metrics]
  listen = "127.0.0.1:9465"   # /metrics, /livez, /readyz
  [log]
  format = "json"             # or "text" (the default)

With several replicas (api_urls), a join or renewal that one replica does
not answer within attempt_timeout, or whose replica fails or is taken out
meanwhile, is sent again (the same bytes) to another healthy replica, and
the first answer wins: a join asked again gets its stored answer, and a
renewal's refusal is held while an earlier copy may have landed. Sessions
are never resent. --print-config prints a commented example
(docs/gateway.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if printConfig {
				_, err := fmt.Fprint(a.env.Stdout, gateway.Example)
				return err
			}
			if err := required("config", path); err != nil {
				return err
			}
			cfg, err := gateway.LoadConfig(path)
			if err != nil {
				return err
			}
			log, err := a.logger(cfg.Log, cmd)
			if err != nil {
				return err
			}
			// With no [tracing] endpoint the global provider is a no-op.
			_, stopTracing, err := tracing.Setup(cfg.Tracing, tracing.ServiceGateway)
			if err != nil {
				return err
			}
			defer func() { _ = stopTracing(context.Background()) }()
			g, err := gateway.New(cfg, gateway.Options{Log: log})
			if err != nil {
				return err
			}
			ctx, cancel := signalContext(cmd.Context())
			defer cancel()
			return g.Run(ctx)
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "TOML config file")
	cmd.Flags().BoolVar(&printConfig, "print-config", false, "print an example config and exit")
	logFlags(cmd)
	return cmd
}
