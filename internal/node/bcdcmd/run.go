package bcdcmd

import (
	"errors"
	"fmt"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// ExitRetired is bcd run's exit code when the control plane says the node
// was retired (R12.1): the node can never reconnect, so bcd stops, and
// bcd.service lists the code in RestartPreventExitStatus so systemd does
// not start it again. Every other failure exits 1.
const ExitRetired = 3

// runCmd is `bcd run`: the service loop bcd.service starts (R12.1). It
// keeps the node's session to the gateway, runs signed commands, and
// renews the certificate in the same process.
func (a *app) runCmd() *cmdline.Command {
	var configPath, dataDir string
	cmd := &cmdline.Command{
		Use:   "run",
		Short: "Run the node daemon: keep the session to the gateway and renew the certificate",
		Long: `Run the node daemon, as bcd.service does: open the session to the gateway
with the node certificate (Hello, then heartbeats), reconnect with backoff
when it drops, run the control plane's signed commands (node.facts,
acceptance.check; anything not signed by the command-signing key from the
join is refused), and renew the certificate at about 60% of its lifetime.

Under systemd (Type=notify) it reports READY=1 after the first Welcome.
SIGINT or SIGTERM end the session cleanly. An expired identity is refused
with the way back (bcd join --reset --yes, or bcd join --attestor x509pop
within 7 days).

Exit codes: 0 after SIGINT or SIGTERM; 3 when the control plane says this
node was retired ("this node was retired; ..."): bcd stops instead of
reconnecting, and bcd.service does not restart it; 1 for any other error.`,
		Args: noArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error {
			a.started = true
			ctx := cmd.Context() // cancelled on SIGINT/SIGTERM by main
			cfg, err := bcdconfig.Load(configPath)
			if err != nil {
				return err
			}
			// --data-dir overrides the config's data_dir, as for join,
			// renew and status: one identity, wherever bcd looks for it.
			dir, err := absDir("--data-dir", dataDir)
			if err != nil {
				return err
			}
			if dir != "" {
				c := *cfg
				c.DataDir = dir
				cfg = &c
			}
			// The daemon logs its life at info level, unlike the one-shot
			// commands.
			lc := cfg.Log
			if lc.Level == "" {
				lc.Level = "info"
			}
			log, err := telemetry.NewLogger(a.env.Stderr, lc)
			if err != nil {
				return err
			}
			httpClient, stopTracing, err := a.traced(cfg)
			if err != nil {
				return err
			}
			defer stopTracing()
			notifySocket, _ := a.env.LookupEnv("NOTIFY_SOCKET")
			p, err := run.NewProcess(run.ProcessConfig{BCD: cfg, ConfigPath: configPath, Log: log, Clock: a.env.Clock, HTTPClient: httpClient,
				NotifySocket: notifySocket, DiagReady: a.env.DiagReady})
			if err != nil {
				return err
			}
			err = p.Run(ctx)
			if errors.Is(err, run.ErrRetired) {
				fmt.Fprintf(a.env.Stderr, "Error: %s\n", errorLine(err))
				return &exitError{code: ExitRetired}
			}
			return err
		},
	}
	cmd.Flags().StringVar(&configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml")
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "the identity's directory (default: the config's data_dir)")
	return cmd
}
