package bcdcmd

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/diag"
	"github.com/better-compute/better-compute/internal/node/doctor"
	"github.com/better-compute/better-compute/internal/node/enroll"
	"github.com/better-compute/better-compute/internal/node/identity"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/run"
	"github.com/better-compute/better-compute/internal/node/servertime"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
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
func (a *app) runCmd() *cobra.Command {
	var configPath, dataDir string
	cmd := &cobra.Command{
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
		RunE: func(cmd *cobra.Command, _ []string) error {
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
			base, err := telemetry.NewLogger(a.env.Stderr, lc)
			if err != nil {
				return err
			}
			keys, store, err := tpmkeys.Stores(cfg, cfg.DataDir)
			if err != nil {
				return err
			}
			// R17.2: /livez, /readyz and /metrics when [diagnostics]
			// listen is set; the renewer's and session's hooks feed it.
			// One offset from the control plane's clock for the renewer,
			// the session and the diagnostics (R19.3).
			serverTime := servertime.New(servertime.Config{Dir: store.Dir, Clock: a.env.Clock})
			dg := diag.New(store, serverTime.Now)
			log := base
			if err := dg.Serve(ctx, cfg.Diagnostics, log, a.env.DiagReady); err != nil {
				return err
			}
			// A renewal tells the session at once (R19.3); a renewal the
			// session has not taken yet is enough, so the channel holds one.
			renewed := make(chan struct{}, 1)
			// One live pin set for the renewer and the session (R16.2):
			// a key either learns is saved to config.toml and used by both.
			pins := config.NewPins(configPath, cfg, log)
			// One TLS ticket cache too: a renewal resumes the session's
			// TLS session with the gateway (same identity, same gateway).
			tickets := &enroll.TicketCache{}
			httpClient, stopTracing, err := a.traced(cfg)
			if err != nil {
				return err
			}
			defer stopTracing()
			r, err := renew.New(renew.Config{BCD: cfg, Store: store, Keys: keys, Clock: a.env.Clock, ServerTime: serverTime, HTTPClient: httpClient, Log: log, Pins: pins, Tickets: tickets,
				OnRenewed: func(id *identity.Identity) {
					dg.Renewed(id)
					select {
					case renewed <- struct{}{}:
					default:
					}
				},
				OnFailed: dg.RenewalFailed})
			if err != nil {
				return err
			}
			notifySocket, _ := a.env.LookupEnv("NOTIFY_SOCKET")
			// R21.5: an expired certificate re-joins by x509pop by itself.
			rejoin := func(ctx context.Context) (*identity.Identity, error) {
				j, err := enroll.New(enroll.Config{BCD: cfg, ConfigPath: configPath, Store: store, Keys: keys, Clock: a.env.Clock,
					HTTPClient: httpClient, Log: log, ServerTime: serverTime, Pins: pins,
					Progress: func(line string) { log.Info(line) }})
				if err != nil {
					return nil, err
				}
				return j.Join(ctx, enroll.Options{Attestor: identity.AttestorX509Pop})
			}
			d, err := run.New(run.Config{BCD: cfg, Store: store, Clock: a.env.Clock, ServerTime: serverTime, Log: log, Renewer: r, Renewed: renewed, NotifySocket: notifySocket, Pins: pins, Tickets: tickets,
				OnWelcome: dg.Welcomed, OnSessionEnded: dg.SessionEnded, Rejoin: rejoin})
			if err != nil {
				return err
			}
			err = d.Run(ctx)
			if errors.Is(err, run.ErrRetired) {
				// For bcd doctor: only a session learns of it.
				if id, lerr := store.Load(); lerr == nil {
					if werr := doctor.RecordRetired(store.Dir, id, a.env.Clock.Now()); werr != nil {
						log.Warn("cannot record the retirement for bcd doctor", telemetry.LogErr, werr)
					}
				}
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
