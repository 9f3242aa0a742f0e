package bcdcmd

import (
	"context"
	"fmt"
	"time"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/config"
	"github.com/better-compute/better-compute/internal/node/renew"
	"github.com/better-compute/better-compute/internal/node/tpmkeys"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

type renewFlags struct {
	configPath string
	dataDir    string
	json       bool
}

func (a *app) renewCmd() *cmdline.Command {
	var f renewFlags
	cmd := &cmdline.Command{
		Use:   "renew",
		Short: "Renew this node's certificate now",
		Long: `Renew this node's certificate now, as the daemon does at about 60% of its
lifetime: make a new node key, prove possession of the current one, and save
the new certificate once the signed answer checks out. On failure the current
identity is kept; a refusal's reason is recorded by the control plane as a
security.renew.refused event.`,
		Example: `  bcd renew --config /etc/bcd/config.toml`,
		Args:    noArgs,
		RunE:    func(cmd *cmdline.Command, _ []string) error { return a.renew(cmd.Context(), &f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml")
	fl.StringVar(&f.dataDir, "data-dir", "", "the identity's directory (default: the config's data_dir)")
	fl.BoolVar(&f.json, "json", false, "print the renewed identity as JSON on standard output")
	return cmd
}

func (a *app) renew(ctx context.Context, f *renewFlags) error {
	cfg, err := loadConfig(f.configPath)
	if err != nil {
		return err
	}
	if cfg == nil {
		return errs.New(errs.InvalidConfig, "no bcd config at %s: renewing needs the gateway and the pins from it", f.configPath)
	}
	dataDir, err := absDir("--data-dir", f.dataDir)
	if err != nil {
		return err
	}
	c := *cfg
	if dataDir != "" {
		c.DataDir = dataDir
	}
	c.ApplyDefaults()
	keys, store, err := tpmkeys.Stores(&c, c.DataDir)
	if err != nil {
		return err
	}
	httpClient, stopTracing, err := a.traced(&c)
	if err != nil {
		return err
	}
	defer stopTracing()
	r, err := renew.New(renew.Config{
		BCD: &c, Store: store, Keys: keys, Clock: a.env.Clock, HTTPClient: httpClient, Log: a.log,
		Pins: config.NewPins(f.configPath, &c, a.log),
	})
	if err != nil {
		return err
	}
	id, err := r.RenewOnce(ctx)
	if err != nil {
		return err
	}
	now := a.env.Clock.Now()
	fmt.Fprintf(a.env.Stderr, "renewed %s: serial %s, certificate valid until %s\n", id.NodeID, id.Serial, id.NotAfter.Format(time.RFC3339))
	if f.json {
		return printJSON(a.env.Stdout, statusOf(id, c.DataDir, now))
	}
	return nil
}
