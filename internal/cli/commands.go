package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/structpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// waitPoll is how often `commands enqueue --wait` reads the command.
const waitPoll = 500 * time.Millisecond

// waitGrace is how long --wait keeps reading after the command's expiry,
// for the control plane's sweep to mark it expired.
const waitGrace = 10 * time.Second

func (a *app) commandsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "commands", Short: "Send commands to nodes and read their results"}

	var eTenant, kind, argsJSON string
	var ttl time.Duration
	var wait bool
	enqueue := &cobra.Command{
		Use:   "enqueue NODE_ID --tenant T --kind KIND [--args JSON] [--ttl 10m] [--wait]",
		Short: "Queue a command for a node (delivered over its session, signed by the control plane)",
		Long: `Queue a command for a node. The node's session delivers it signed with the
control plane's command-signing key; bcd verifies and runs it, and its answer
becomes the command's result. Built-in kinds: node.facts (the hardware facts
bcd reads) and acceptance.check (the pool's acceptance checks). The kind must
be allowed by the node's certificate (INVALID_STATE otherwise).

A command not answered within --ttl (at most 24h) expires. With --wait the
CLI reads the command until it is done, failed or expired, printing progress
on stderr; a failed or expired command is an error.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", eTenant); err != nil {
				return err
			}
			if err := required("kind", kind); err != nil {
				return err
			}
			if ttl < time.Second || ttl > 24*time.Hour || ttl%time.Second != 0 {
				return errs.Invalid("--ttl", "want whole seconds from 1s to 24h")
			}
			var st *structpb.Struct
			if argsJSON != "" {
				var m map[string]any
				if err := json.Unmarshal([]byte(argsJSON), &m); err != nil || m == nil {
					return errs.Invalid("--args", "want a JSON object, e.g. '{\"verbose\":true}'")
				}
				var err error
				if st, err = structpb.NewStruct(m); err != nil {
					return errs.Invalid("--args", "%v", err)
				}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Commands.EnqueueCommand(cmd.Context(), connect.NewRequest(&bcv1.EnqueueCommandRequest{
				TenantId: eTenant, NodeId: args[0], Kind: kind, Args: st, TtlSeconds: int32(ttl / time.Second)}))
			if err != nil {
				return err
			}
			out := res.Msg
			if wait {
				if out, err = a.waitCommand(cmd.Context(), c, eTenant, out); err != nil {
					return err
				}
			}
			return a.showCommand(out)
		},
	}
	enqueue.Flags().StringVar(&eTenant, "tenant", "", "tenant id (tn_…)")
	enqueue.Flags().StringVar(&kind, "kind", "", "command kind, e.g. node.facts")
	enqueue.Flags().StringVar(&argsJSON, "args", "", "arguments as a JSON object")
	enqueue.Flags().DurationVar(&ttl, "ttl", 10*time.Minute, "delivery and answer deadline (at most 24h)")
	enqueue.Flags().BoolVar(&wait, "wait", false, "wait until the command is done, failed or expired")

	var lTenant, node string
	list := &cobra.Command{
		Use: "list --tenant T [--node N]", Short: "List the tenant's commands, newest first", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, need{"tenant", lTenant}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListCommandsResponse], error) {
				return c.Commands.ListCommands(ctx, connect.NewRequest(&bcv1.ListCommandsRequest{TenantId: lTenant, NodeId: node, PageSize: 200, PageToken: tok}))
			}, a.showCommands)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&node, "node", "", "only this node's commands")

	var gTenant string
	get := &cobra.Command{
		Use: "get COMMAND_ID --tenant T", Short: "Show a command and its result", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", gTenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Command], error) {
				return c.Commands.GetCommand(ctx, connect.NewRequest(&bcv1.GetCommandRequest{TenantId: gTenant, CommandId: args[0]}))
			}, a.showCommand)
		},
	}
	get.Flags().StringVar(&gTenant, "tenant", "", "tenant id (tn_…)")
	cmd.AddCommand(enqueue, list, get)
	return cmd
}

// waitCommand reads c until it finished, or until a little after its
// expiry; a command that did not finish done is an error.
func (a *app) waitCommand(ctx context.Context, cl *client.Client, tenant string, c *bcv1.Command) (*bcv1.Command, error) {
	deadline := time.Now().Add(time.Until(c.ExpiresAt.AsTime()) + waitGrace)
	last := ""
	for {
		if c.State != last {
			fmt.Fprintf(a.env.Stderr, "command %s (%s on %s): %s\n", c.Id, c.Kind, c.NodeId, c.State)
			last = c.State
		}
		switch c.State {
		case "done":
			return c, nil
		case "failed", "expired":
			msg := c.Error
			if msg == "" {
				msg = "no error text"
			}
			return nil, errs.New(errs.InvalidState, "command %s %s: %s", c.Id, c.State, msg)
		}
		if time.Now().After(deadline) {
			return nil, errs.New(errs.Unavailable, "command %s is still %s after its expiry at %s", c.Id, c.State, fmtTime(c.ExpiresAt))
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(waitPoll):
		}
		res, err := cl.Commands.GetCommand(ctx, connect.NewRequest(&bcv1.GetCommandRequest{TenantId: tenant, CommandId: c.Id}))
		if err != nil {
			return nil, err
		}
		c = res.Msg
	}
}

func (a *app) showCommands(cs ...*bcv1.Command) error {
	var rows [][]string
	for _, c := range cs {
		rows = append(rows, []string{c.Id, c.NodeId, c.Kind, c.State, fmtTime(c.CreatedAt), fmtTime(c.DoneAt), oneLine(c.Error, 60)})
	}
	a.table([]string{"ID", "NODE", "KIND", "STATE", "CREATED", "DONE", "ERROR"}, rows)
	return nil
}

func (a *app) showCommand(c *bcv1.Command) error {
	if a.wantJSON() {
		return a.printJSON(c)
	}
	args, _ := json.Marshal(c.Args.AsMap())
	a.table([]string{"FIELD", "VALUE"}, [][]string{
		{"id", c.Id}, {"node", c.NodeId}, {"kind", c.Kind}, {"args", string(args)}, {"state", c.State}, {"error", orDash(c.Error)},
		{"created", fmtTime(c.CreatedAt)}, {"sent", fmtTime(c.SentAt)}, {"done", fmtTime(c.DoneAt)}, {"expires", fmtTime(c.ExpiresAt)},
	})
	if c.Result != nil {
		b, err := json.MarshalIndent(c.Result.AsMap(), "", "  ")
		if err != nil {
			return err
		}
		fmt.Fprintf(a.env.Stdout, "\nresult:\n%s\n", b)
	}
	return nil
}

// retireCmd is `nodes retire`.
func (a *app) retireCmd() *cobra.Command {
	var tenant, reason string
	retire := &cobra.Command{
		Use:   "retire NODE_ID --tenant T [--reason R]",
		Short: "Retire a node: revoke its certificates and end its session",
		Long: `Retire a node. Its state becomes retired, every certificate it holds is
revoked, its queued commands fail and its session ends. A retired node can
neither renew its certificate nor open a session; the machine comes back only
by joining again with a new token, as a new node. Retiring a retired node is
not an error.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", tenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Node], error) {
				return c.Nodes.RetireNode(ctx, connect.NewRequest(&bcv1.RetireNodeRequest{TenantId: tenant, NodeId: args[0], Reason: reason}))
			}, func(n *bcv1.Node) error {
				a.table([]string{"ID", "HOSTNAME", "STATE", "CONNECTION", "POOL", "GEN"},
					[][]string{{n.Id, n.Hostname, n.State + reasonSuffix(n.StateReason), n.Connection, n.PoolId, fmt.Sprint(n.IdentityGeneration)}})
				return nil
			})
		},
	}
	retire.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	retire.Flags().StringVar(&reason, "reason", "", "why, recorded as the node's state reason and in the audit log")
	return retire
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine shortens s to n characters for a table cell (which escapes it).
func oneLine(s string, n int) string {
	r := []rune(s)
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return orDash(string(r))
}
