package cli

import (
	"log/slog"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/bcd/config"
	"github.com/better-compute/better-compute/internal/bcd/identity"
	"github.com/better-compute/better-compute/internal/bcd/renew"
	"github.com/better-compute/better-compute/internal/bcd/run"
)

// runCmd is `bcd run`: the service loop bcd.service starts (R12.1). It
// keeps the node's session to the gateway, runs signed commands, and
// renews the certificate in the same process.
func (a *app) runCmd() *cobra.Command {
	var configPath string
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the node daemon: keep the session to the gateway and renew the certificate",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := config.Load(configPath)
			if err != nil {
				return err
			}
			// The daemon logs its life at info level, unlike the one-shot
			// commands.
			log := slog.New(slog.NewTextHandler(a.env.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			store := &identity.Store{Dir: cfg.DataDir}
			r, err := renew.New(renew.Config{BCD: cfg, Store: store, Clock: a.env.Clock, HTTPClient: a.env.HTTPClient, Log: log})
			if err != nil {
				return err
			}
			notifySocket, _ := a.env.LookupEnv("NOTIFY_SOCKET")
			d, err := run.New(run.Config{BCD: cfg, Store: store, Clock: a.env.Clock, Log: log, Renewer: r, NotifySocket: notifySocket})
			if err != nil {
				return err
			}
			return d.Run(cmd.Context())
		},
	}
	cmd.Flags().StringVar(&configPath, "config", config.DefaultPath, "bcd's config.toml")
	return cmd
}
