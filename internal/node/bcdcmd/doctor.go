package bcdcmd

import (
	"encoding/json"
	"fmt"
	"text/tabwriter"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig"

	"github.com/better-compute/better-compute/internal/node/cmdline"
	"github.com/better-compute/better-compute/internal/node/doctor"
)

func (a *app) doctorCmd() *cmdline.Command {
	var configPath, dataDir string
	var asJSON bool
	cmd := &cmdline.Command{
		Use:   "doctor",
		Short: "Check the config, join key, identity, gateway and TPM (exit code 1 when a check fails)",
		Args:  noArgs,
		RunE: func(cmd *cmdline.Command, _ []string) error {
			a.started = true
			checks := doctor.Run(cmd.Context(), doctor.Options{ConfigPath: configPath, DataDir: dataDir, Clock: a.env.Clock})
			if asJSON {
				enc := json.NewEncoder(a.env.Stdout)
				enc.SetIndent("", "  ")
				if err := enc.Encode(map[string]any{"ok": !doctor.Failed(checks), "checks": checks}); err != nil {
					return err
				}
			} else {
				tw := tabwriter.NewWriter(a.env.Stdout, 0, 4, 2, ' ', 0)
				fmt.Fprintln(tw, "CHECK\tSTATUS\tDETAIL")
				for _, c := range checks {
					fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Name, c.Status, c.Detail)
				}
				tw.Flush()
			}
			if doctor.Failed(checks) {
				return &exitError{code: 1}
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&configPath, "config", bcdconfig.DefaultPath, "bcd's config.toml")
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "the identity's directory (default: the config's data_dir)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
