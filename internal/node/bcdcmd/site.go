package bcdcmd

import (
	"fmt"

	"github.com/better-compute/better-compute/internal/node/cmdline"

	"github.com/better-compute/better-compute/internal/node/site"
	"github.com/better-compute/better-compute/internal/shared/bcdconfig"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// siteCmd is `bcd site`: the site agent's side of discovery (R10.4).
func (a *app) siteCmd() *cmdline.Command {
	cmd := &cmdline.Command{
		Use:   "site",
		Short: "Site agent: record the machines this site booted, for bcd run to vouch for",
		Long: `A site agent is bcd joined with role site (a site token, minted by the control
plane's site module). While bcd run runs, it reports the machines the site
booted over the network to the control plane over its session, signed by its
node key; a ramdisk that then joins with --attestor discovery is admitted only
with such a vouch from its own site, for its current boot lease.

The site's boot module (a DHCP/PXE hook) records each boot in the data
directory's booted.jsonl, one JSON line per boot; bcd site vouch does the same
by hand.`,
	}
	cmd.AddCommand(a.siteVouchCmd())
	return cmd
}

func (a *app) siteVouchCmd() *cmdline.Command {
	var configPath, dataDir string
	var m site.Machine
	cmd := &cmdline.Command{
		Use:   "vouch --mac MAC --ip IP --lease-epoch N",
		Short: "Record that this site booted a machine (its MAC, address and boot lease epoch)",
		Long: `Record a network boot in the booted file (<data_dir>/booted.jsonl), as the
site's boot module does. bcd run, joined with role site, reports it within
seconds. A newer lease epoch for the same MAC replaces the older boot; an older
one is ignored.`,
		Example: `  bcd site vouch --config /etc/bcd/config.toml --mac 52:54:00:12:34:56 --ip 10.0.0.7 --lease-epoch 3`,
		Args:    cmdline.NoArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error {
			dir := dataDir
			if dir == "" {
				cfg, err := loadConfig(configPath)
				if err != nil {
					return err
				}
				dir = bcdconfig.DefaultDataDir
				if cfg != nil && cfg.DataDir != "" {
					dir = cfg.DataDir
				}
			}
			if m.MAC == "" || m.IP == "" || m.LeaseEpoch == 0 {
				return errs.New(errs.InvalidArgument, "give the boot: --mac, --ip and --lease-epoch")
			}
			path := site.BootedPath(dir)
			if err := site.Append(path, m); err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stderr, "recorded the boot of %s (%s, lease epoch %d) in %s; bcd run reports it\n", m.MAC, m.IP, m.LeaseEpoch, path)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml (for its data_dir)")
	f.StringVar(&dataDir, "data-dir", "", "the site agent's data directory (default: the config's data_dir)")
	f.StringVar(&m.MAC, "mac", "", "the MAC of the NIC the machine booted from")
	f.StringVar(&m.IP, "ip", "", "the address its boot lease gave")
	f.Int64Var(&m.LeaseEpoch, "lease-epoch", 0, "the boot lease's epoch (a newer boot of the same NIC has a higher one)")
	f.StringVar(&m.WorkflowID, "workflow-id", "", "the provisioning workflow, when the site names one")
	return cmd
}
