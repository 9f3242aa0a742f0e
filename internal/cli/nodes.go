package cli

import (
	"context"
	"encoding/json"
	"fmt"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
)

func (a *app) nodesCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "nodes", Short: "Create ahead, list, inspect and retire nodes"}
	var tenant, pool string
	list := &cobra.Command{
		Use: "list --tenant T [--pool P]", Short: "List the tenant's nodes", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, need{"tenant", tenant}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListNodesResponse], error) {
				return c.Nodes.ListNodes(ctx, connect.NewRequest(&bcv1.ListNodesRequest{TenantId: tenant, PoolId: pool, PageSize: 200, PageToken: tok}))
			}, a.showNodes)
		},
	}
	list.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&pool, "pool", "", "only nodes of this pool")

	var gTenant string
	get := &cobra.Command{
		Use: "get NODE_ID --tenant T", Short: "Show a node, its hardware claims and certificates", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", gTenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Node], error) {
				return c.Nodes.GetNode(ctx, connect.NewRequest(&bcv1.GetNodeRequest{TenantId: gTenant, NodeId: args[0]}))
			}, a.showNode)
		},
	}
	get.Flags().StringVar(&gTenant, "tenant", "", "tenant id (tn_…)")
	cmd.AddCommand(a.nodeCreateCmd(), list, get, a.retireCmd())
	return cmd
}

func (a *app) showNodes(ns ...*bcv1.Node) error {
	var rows [][]string
	for _, n := range ns {
		rows = append(rows, []string{n.Id, n.Hostname, n.State, n.Connection, n.Role, n.PoolId, fmt.Sprint(n.IdentityGeneration), n.Attestor, n.NodeKey})
	}
	a.table([]string{"ID", "HOSTNAME", "STATE", "CONNECTION", "ROLE", "POOL", "GEN", "ATTESTOR", "NODE KEY"}, rows)
	return nil
}

// showNode prints one node with its hardware claims and certificates.
func (a *app) showNode(n *bcv1.Node) error {
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
}

func reasonSuffix(r string) string {
	if r == "" {
		return ""
	}
	return " (" + r + ")"
}

func (a *app) nodeCreateCmd() *cobra.Command {
	var tenant, pool, hostname, key string
	create := &cobra.Command{
		Use:   "create --tenant T --pool P [--hostname H] [--key K]",
		Short: "Make a node ahead of its machine and print its id",
		Long: `Make a node before its machine exists, for a deploy that installs the OS
and then joins it: the node is pending (identity generation 0, no hardware
key, no certificate) until bcd join --node-id NODE_ID binds a machine to it,
with a join token of the node's pool.

The id alone is printed, so a script can capture it; --json prints the node.
--key makes the call idempotent: the same key again prints the same node.`,
		Example: `  NODE=$(better-compute nodes create --tenant $TENANT --pool $POOL --hostname gpu-07 --key deploy-gpu-07)
  bcd join --server https://compute.example.com --token-file ./join-token --node-id $NODE`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", tenant, "pool", pool}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Node], error) {
				return c.Nodes.CreateNode(ctx, connect.NewRequest(&bcv1.CreateNodeRequest{TenantId: tenant, PoolId: pool, Hostname: hostname, IdempotencyKey: key}))
			}, func(n *bcv1.Node) error {
				_, err := fmt.Fprintln(a.env.Stdout, n.Id)
				return err
			})
		},
	}
	f := create.Flags()
	f.StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	f.StringVar(&pool, "pool", "", "pool id (pool_…) the machine will join")
	f.StringVar(&hostname, "hostname", "", "the name it is known by until its machine reports its own")
	f.StringVar(&key, "key", "", "idempotency key: the same key again prints the same node")
	return create
}
