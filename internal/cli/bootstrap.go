package cli

import (
	"fmt"
	"log/slog"

	"github.com/spf13/cobra"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/server"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
)

func (a *app) bootstrapCmd() *cobra.Command {
	var path, name string
	cmd := &cobra.Command{
		Use:   "bootstrap --config FILE [--name NAME]",
		Short: "Create the root tenant and a platform admin API key (first install)",
		Long: `Open the database named in the server config directly, make sure the root
tenant exists, and mint an API key with every grant in it. The key is printed
once. Run it on a host that can reach the database, once per installation (or
again to mint another admin key; each needs its own --name).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("config", path); err != nil {
				return err
			}
			cfg, err := server.LoadConfig(path)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			db, err := store.Open(ctx, cfg.Store, slog.New(slog.DiscardHandler))
			if err != nil {
				return err
			}
			defer db.Close()
			root, _, err := tenancy.New(tenancy.Config{DB: db}).Bootstrap(ctx, cfg.RootTenant)
			if err != nil {
				return err
			}
			// The same path as the API's CreateApiKey: the key, its event and
			// its audit row, by the bootstrap principal of the root tenant.
			boot := authz.Principal{ID: "bootstrap", TenantID: root.ID, Name: "bootstrap", Grants: authz.Admin, Root: true}
			_, key, err := authz.New(authz.Config{DB: db}).CreateKey(ctx, boot, root.ID, name, authz.Admin, 0)
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(map[string]string{"tenantId": root.ID, "apiKey": key})
			}
			fmt.Fprintf(a.env.Stdout, "root tenant: %s\nadmin API key (shown once): %s\n\nexport BETTER_COMPUTE_API_KEY=%s TENANT=%s\n", root.ID, key, key, root.ID)
			return nil
		},
	}
	cmd.Flags().StringVar(&path, "config", "", "the server's TOML config")
	cmd.Flags().StringVar(&name, "name", "admin", "name of the key's principal")
	return cmd
}
