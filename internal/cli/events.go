package cli

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/structpb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

func sorted(s []string) []string { slices.Sort(s); return s }

// summaryWidth bounds the SUMMARY column of events and audit tables.
const summaryWidth = 80

// summaryFirst are the data fields a summary shows first, when present.
var summaryFirst = []string{"reason", "error", "state", "previousState", "kind", "attestor", "role"}

// summaryShort is the longest value shown among the short fields, which
// come before the long ones.
const summaryShort = 24

// summary renders an event's or audit row's data for a table:
// key=value pairs, the fields of summaryFirst first, then short
// values, then long ones, each group in key order; a value equal to skip
// (the subject or resource already in its own column), false and empty
// values are left out; nested objects and lists are shortened; the whole is
// cut to summaryWidth characters. --json prints the data in full. The
// table escapes the text (termsafe.go), so the quoting here only marks
// where a value with spaces begins and ends.
func summary(data *structpb.Struct, skip string) string {
	m := data.AsMap()
	type kv struct{ k, v string }
	var first, short, long []kv
	for k, raw := range m {
		switch x := raw.(type) {
		case nil:
			continue
		case bool:
			if !x {
				continue
			}
		case string:
			if x == "" || x == skip {
				continue
			}
		}
		p := kv{k, summaryValue(raw)}
		switch {
		case slices.Contains(summaryFirst, k):
			first = append(first, p)
		case len(p.v) <= summaryShort:
			short = append(short, p)
		default:
			long = append(long, p)
		}
	}
	slices.SortFunc(first, func(a, b kv) int { return slices.Index(summaryFirst, a.k) - slices.Index(summaryFirst, b.k) })
	byKey := func(a, b kv) int { return strings.Compare(a.k, b.k) }
	slices.SortFunc(short, byKey)
	slices.SortFunc(long, byKey)
	var parts []string
	for _, p := range slices.Concat(first, short, long) {
		parts = append(parts, p.k+"="+p.v)
	}
	if len(parts) == 0 {
		return "-"
	}
	return oneLine(strings.Join(parts, " "), summaryWidth)
}

func summaryValue(v any) string {
	switch x := v.(type) {
	case string:
		if strings.ContainsAny(x, " =\"") {
			return `"` + strings.ReplaceAll(x, `"`, `\"`) + `"`
		}
		return x
	case bool:
		return strconv.FormatBool(x)
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64)
	case []any:
		if len(x) == 0 {
			return "[]"
		}
		if len(x) == 1 {
			return "[" + summaryValue(x[0]) + "]"
		}
		return fmt.Sprintf("[%d items]", len(x))
	case map[string]any:
		if len(x) == 0 {
			return "{}"
		}
		return "{…}"
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// pageSize is the page a list call answers when asked for limit rows (the
// API's rule: 0 means 100, at most 200).
func pageSize(limit int32) int {
	if limit <= 0 {
		return 100
	}
	return int(min(limit, 200))
}

func (a *app) eventsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "events", Short: "Read a tenant's event stream"}
	var tenant, cursor, typ string
	var follow bool
	var limit int32
	list := &cobra.Command{
		Use:   "list --tenant T [--type PREFIX] [--cursor C] [--follow]",
		Short: "List events in commit order; --follow waits for new ones",
		Long: `List a tenant's events in the order they committed: time, type, subject and
a one-line summary of the event's data. Each event carries a cursor; the last
one is printed on stderr, and --cursor resumes after it. --follow keeps
waiting for new events until interrupted. With --json, events print one JSON
object per line, with their full data and cursor.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			header := true
			var rows [][]string
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
					rows = append(rows, []string{e.Time.AsTime().UTC().Format(time.RFC3339), e.Type, e.Subject, summary(e.Data, e.Subject)})
				}
				cursor = res.Msg.NextCursor
				last := !follow && len(res.Msg.Events) < pageSize(limit)
				if len(rows) > 0 && (follow || last) {
					// One aligned table; with --follow, one per batch, so
					// events print as they arrive.
					a.tableRows([]string{"TIME", "TYPE", "SUBJECT", "SUMMARY"}, rows, header)
					header, rows = false, nil
				}
				if last {
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
	var tenant, cursor string
	var limit int32
	list := &cobra.Command{
		Use:   "list --tenant T [--cursor C] [--limit N]",
		Short: "List audit rows, oldest first, from a cursor",
		Long: `List a tenant's audit rows (who did what, when, on what) oldest first, as
events list does: time, actor, action, resource and a one-line summary of the
row's data. Every row after --cursor is read, page by page; the cursor of the
last row is printed on stderr, and --cursor resumes after it. With --json,
rows print one JSON object per line, with their full data and cursor.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			var rows [][]string
			for {
				res, err := c.Events.ListAudit(cmd.Context(), connect.NewRequest(&bcv1.ListAuditRequest{TenantId: tenant, PageSize: limit, Cursor: cursor}))
				if err != nil {
					return err
				}
				for _, e := range res.Msg.Items {
					if a.wantJSON() {
						b, _ := stableJSON(e, "")
						fmt.Fprintln(a.env.Stdout, string(b))
						continue
					}
					_, id, _ := strings.Cut(e.Resource, "/")
					rows = append(rows, []string{e.Time.AsTime().UTC().Format(time.RFC3339), e.Actor, e.Action, e.Resource, summary(e.Data, id)})
				}
				cursor = res.Msg.NextCursor
				if len(res.Msg.Items) < pageSize(limit) {
					if !a.wantJSON() {
						a.table([]string{"TIME", "ACTOR", "ACTION", "RESOURCE", "SUMMARY"}, rows)
						fmt.Fprintf(a.env.Stderr, "cursor: %s\n", cursor)
					}
					return nil
				}
			}
		},
	}
	list.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&cursor, "cursor", "", "resume after this cursor")
	list.Flags().Int32Var(&limit, "limit", 100, "rows per request (at most 200)")
	cmd.AddCommand(list)
	return cmd
}
