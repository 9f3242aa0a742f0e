package cli

import (
	"encoding/json"
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

func (a *app) nodesCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "nodes", Short: "List, inspect and retire nodes"}
	var tenant, pool string
	list := &cobra.Command{
		Use: "list --tenant T [--pool P]", Short: "List the tenant's nodes", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			all, err := allPages(func(tok string) ([]*bcv1.Node, string, error) {
				res, err := c.Nodes.ListNodes(cmd.Context(), connect.NewRequest(&bcv1.ListNodesRequest{TenantId: tenant, PoolId: pool, PageSize: 200, PageToken: tok}))
				if err != nil {
					return nil, "", err
				}
				return res.Msg.Items, res.Msg.NextPageToken, nil
			})
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(&bcv1.ListNodesResponse{Items: all})
			}
			var rows [][]string
			for _, n := range all {
				rows = append(rows, []string{n.Id, n.Hostname, n.State, n.Connection, n.Role, n.PoolId, fmt.Sprint(n.IdentityGeneration), n.Attestor, n.NodeKey})
			}
			a.table([]string{"ID", "HOSTNAME", "STATE", "CONNECTION", "ROLE", "POOL", "GEN", "ATTESTOR", "NODE KEY"}, rows)
			return nil
		},
	}
	list.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&pool, "pool", "", "only nodes of this pool")

	var gTenant string
	get := &cobra.Command{
		Use: "get NODE_ID --tenant T", Short: "Show a node, its hardware claims and certificates", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", gTenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Nodes.GetNode(cmd.Context(), connect.NewRequest(&bcv1.GetNodeRequest{TenantId: gTenant, NodeId: args[0]}))
			if err != nil {
				return err
			}
			n := res.Msg
			if a.wantJSON() {
				return a.printJSON(n)
			}
			claims, _ := json.Marshal(n.Claims.AsMap())
			a.table([]string{"FIELD", "VALUE"}, [][]string{
				{"id", n.Id}, {"tenant", n.TenantId}, {"site", n.SiteId}, {"pool", n.PoolId}, {"role", n.Role},
				{"state", n.State + reasonSuffix(n.StateReason)}, {"connection", n.Connection}, {"last seen", fmtTime(n.LastSeen)},
				{"identity generation", fmt.Sprint(n.IdentityGeneration)}, {"hardware key trusted", fmt.Sprint(n.HardwareKeyTrusted)},
				{"node key", n.NodeKey}, {"attestor", n.Attestor}, {"hostname", n.Hostname}, {"claims", string(claims)},
				{"created", fmtTime(n.CreatedAt)},
			})
			fmt.Fprintln(a.env.Stdout)
			var rows [][]string
			for _, c := range n.Certs {
				state := "valid"
				if c.RevokedAt != nil {
					state = "revoked (" + c.RevokeReason + ")"
				}
				rows = append(rows, []string{c.Serial, fmt.Sprint(c.IdentityGeneration), c.Role, fmtTime(c.NotBefore), fmtTime(c.NotAfter), state})
			}
			a.table([]string{"CERT SERIAL", "GEN", "ROLE", "NOT BEFORE", "NOT AFTER", "STATE"}, rows)
			return nil
		},
	}
	get.Flags().StringVar(&gTenant, "tenant", "", "tenant id (tn_…)")
	cmd.AddCommand(list, get, a.retireCmd())
	return cmd
}

func reasonSuffix(r string) string {
	if r == "" {
		return ""
	}
	return " (" + r + ")"
}
