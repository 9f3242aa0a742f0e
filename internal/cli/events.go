package cli

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

func sorted(s []string) []string { slices.Sort(s); return s }

func (a *app) eventsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "events", Short: "Read a tenant's event stream"}
	var tenant, cursor, typ string
	var follow bool
	var limit int32
	list := &cobra.Command{
		Use:   "list --tenant T [--type PREFIX] [--cursor C] [--follow]",
		Short: "List events in commit order; --follow waits for new ones",
		Long: `List a tenant's events in the order they committed. Each event carries a
cursor; pass the last one with --cursor to resume. --follow keeps waiting for
new events until interrupted. With --json, events print one JSON object per
line.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			header := !a.wantJSON()
			for {
				var wait int32
				if follow {
					wait = 25
				}
				res, err := c.Events.ListEvents(cmd.Context(), connect.NewRequest(&bcv1.ListEventsRequest{TenantId: tenant, Cursor: cursor, TypePrefix: typ, Limit: limit, WaitSeconds: wait}))
				if err != nil {
					if follow && cmd.Context().Err() != nil {
						return nil
					}
					return err
				}
				for _, e := range res.Msg.Events {
					if a.wantJSON() {
						b, _ := stableJSON(e, "")
						fmt.Fprintln(a.env.Stdout, string(b))
						continue
					}
					if header {
						fmt.Fprintf(a.env.Stdout, "%-20s  %-36s  %-30s  %s\n", "TIME", "TYPE", "SUBJECT", "DATA")
						header = false
					}
					data, _ := json.Marshal(e.Data.AsMap())
					fmt.Fprintf(a.env.Stdout, "%-20s  %-36s  %-30s  %s\n", e.Time.AsTime().UTC().Format(time.RFC3339), e.Type, e.Subject, data)
				}
				cursor = res.Msg.NextCursor
				page := int(limit)
				if page <= 0 || page > 200 {
					page = min(max(page, 100), 200)
				}
				if !follow && len(res.Msg.Events) < page {
					if !a.wantJSON() {
						fmt.Fprintf(a.env.Stderr, "cursor: %s\n", cursor)
					}
					return nil
				}
			}
		},
	}
	list.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&cursor, "cursor", "", "resume after this cursor")
	list.Flags().StringVar(&typ, "type", "", "only types starting with this, e.g. security.")
	list.Flags().BoolVarP(&follow, "follow", "f", false, "keep waiting for new events")
	list.Flags().Int32Var(&limit, "limit", 100, "events per request (at most 200)")
	cmd.AddCommand(list)
	return cmd
}

func (a *app) auditCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "audit", Short: "Read a tenant's audit log"}
	var tenant string
	var limit int32
	list := &cobra.Command{
		Use: "list --tenant T [--limit N]", Short: "List audit rows, newest first", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Events.ListAudit(cmd.Context(), connect.NewRequest(&bcv1.ListAuditRequest{TenantId: tenant, PageSize: limit}))
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(res.Msg)
			}
			var rows [][]string
			for _, e := range res.Msg.Items {
				data, _ := json.Marshal(e.Data.AsMap())
				rows = append(rows, []string{e.Time.AsTime().UTC().Format(time.RFC3339), e.Actor, e.Action, e.Resource, string(data)})
			}
			a.table([]string{"TIME", "ACTOR", "ACTION", "RESOURCE", "DATA"}, rows)
			return nil
		},
	}
	list.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().Int32Var(&limit, "limit", 100, "rows to show (at most 200)")
	cmd.AddCommand(list)
	return cmd
}
