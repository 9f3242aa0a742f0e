// Package cli is the better-compute command line: the operator commands
// (tenants, sites, pools, api-keys, join-tokens, events, audit), the PKI
// commands, and the server processes (serve, dev). Every command prints a
// table for people or JSON with --json, and errors as "Error: CODE: message"
// with a non-zero exit.
package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/shared/cmdtree"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/version"
)

// Env is the process environment the CLI runs in, injected for tests.
type Env struct {
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	Getenv func(string) string
}

// CAFileEnv names the PEM file of CAs that verify the control plane, the
// default of --ca-file (better-compute dev writes it into dev.env).
const CAFileEnv = "BETTER_COMPUTE_CA_FILE"

type app struct {
	env    Env
	url    string
	apiKey string
	caFile string
	json   bool
	output string
}

// Main runs the CLI and returns the exit code.
func Main(ctx context.Context, args []string, env Env) int {
	if env.Getenv == nil {
		env.Getenv = os.Getenv
	}
	// Nothing reaches the terminal raw (termsafe.go).
	stdout, stderr := newSafeWriter(env.Stdout), newSafeWriter(env.Stderr)
	defer stdout.Flush()
	defer stderr.Flush()
	env.Stdout, env.Stderr = stdout, stderr
	a := &app{env: env}
	root := a.rootCmd()
	cmdtree.GuardGroups(root)
	codeUsageErrors(root)
	root.SetArgs(args)
	root.SetIn(env.Stdin)
	root.SetOut(env.Stdout)
	root.SetErr(env.Stderr)
	if cmd, err := root.ExecuteContextC(ctx); err != nil {
		err = asFlag(cmd, coded(err))
		var e *errs.E
		if errors.As(err, &e) {
			fmt.Fprintf(env.Stderr, "Error: %s: %s\n", e.Code, e.Message)
		} else {
			fmt.Fprintf(env.Stderr, "Error: %v\n", err)
		}
		return 1
	}
	return 0
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "better-compute",
		Short: "Operate a better-compute control plane: pools, join tokens and requests, nodes, PKI",
		Long: `better-compute turns machines into nodes of a compute fleet.

Start a local control plane with 'better-compute dev', then 'source' the
dev.env it writes; the operator commands read BETTER_COMPUTE_URL,
BETTER_COMPUTE_API_KEY and BETTER_COMPUTE_CA_FILE (flags override them).`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Version:       version.Version,
	}
	pf := root.PersistentFlags()
	pf.StringVar(&a.url, "url", "", "control plane URL (default $BETTER_COMPUTE_URL)")
	pf.StringVar(&a.apiKey, "api-key", "", "API key bck_… (default $BETTER_COMPUTE_API_KEY)")
	pf.StringVar(&a.caFile, "ca-file", "", "PEM CAs that verify the control plane (default $"+CAFileEnv+", else the system roots)")
	pf.BoolVar(&a.json, "json", false, "print JSON for scripts")
	pf.StringVarP(&a.output, "output", "o", "table", "output format: table or json")
	root.AddCommand(
		a.tenantsCmd(), a.sitesCmd(), a.poolsCmd(), a.apiKeysCmd(), a.joinTokensCmd(), a.joinRequestsCmd(),
		a.nodesCmd(), a.commandsCmd(), a.eventsCmd(), a.auditCmd(), a.pkiCmd(), a.serveCmd(), a.bootstrapCmd(), a.gatewayCmd(), a.devCmd(), a.versionCmd(),
		a.daemonCmd(),
	)
	root.AddCommand(a.backupCmds()...)
	return root
}

func (a *app) versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if a.wantJSON() {
				return a.printJSON(map[string]string{"version": version.Version})
			}
			fmt.Fprintln(a.env.Stdout, version.Version)
			return nil
		},
	}
}

func (a *app) wantJSON() bool { return a.json || a.output == "json" }

func (a *app) client() (*client.Client, error) {
	url := a.url
	if url == "" {
		url = a.env.Getenv("BETTER_COMPUTE_URL")
	}
	key := a.apiKey
	if key == "" {
		key = a.env.Getenv("BETTER_COMPUTE_API_KEY")
	}
	if key == "" {
		return nil, errs.New(errs.Unauthenticated, "no API key: set BETTER_COMPUTE_API_KEY or pass --api-key")
	}
	if a.output != "table" && a.output != "json" {
		return nil, errs.Invalid("--output", "want table or json")
	}
	ca := a.caFile
	if ca == "" {
		ca = a.env.Getenv(CAFileEnv)
	}
	return client.New(client.Config{URL: url, APIKey: key, CAFile: ca})
}

// printJSON prints a protobuf message (or a list of them) as JSON.
func (a *app) printJSON(v any) error {
	switch m := v.(type) {
	case proto.Message:
		b, err := stableJSON(m, "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(a.env.Stdout, string(b))
		return err
	default:
		enc := json.NewEncoder(a.env.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
}

// stableJSON marshals a message with protojson and re-formats it with
// encoding/json: protojson varies its whitespace on purpose, and scripts
// (and people diffing output) deserve the same bytes every time.
func stableJSON(m proto.Message, indent string) ([]byte, error) {
	raw, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if indent == "" {
		err = json.Compact(&buf, raw)
	} else {
		err = json.Indent(&buf, raw, "", indent)
	}
	return buf.Bytes(), err
}

// allPages walks a list call's pages with its page token and returns every
// item.
func allPages[T any](page func(token string) ([]T, string, error)) ([]T, error) {
	var all []T
	token := ""
	for {
		items, next, err := page(token)
		if err != nil {
			return nil, err
		}
		all = append(all, items...)
		if next == "" {
			return all, nil
		}
		token = next
	}
}

// pageOf is a List call's answer: its items and the next page's token.
type pageOf[T, R any] interface {
	*R
	proto.Message
	GetItems() []T
	GetNextPageToken() string
}

// listAll reads every page of one List call through the API client: the
// plumbing every list subcommand shares. T is the item type (the response
// type is inferred from call).
func listAll[T, R any, PR pageOf[T, R]](a *app, call func(c *client.Client, token string) (*connect.Response[R], error)) ([]T, error) {
	c, err := a.client()
	if err != nil {
		return nil, err
	}
	return allPages(func(tok string) ([]T, string, error) {
		res, err := call(c, tok)
		if err != nil {
			return nil, "", err
		}
		m := PR(res.Msg)
		return m.GetItems(), m.GetNextPageToken(), nil
	})
}

// table prints rows under a header, aligned. Every cell is escaped
// (termsafe.go): node-controlled text cannot break the columns, forge rows
// or reach the terminal as control characters.
func (a *app) table(header []string, rows [][]string) {
	a.tableRows(header, rows, true)
}

// tableRows prints rows aligned, under the header when withHeader is set.
func (a *app) tableRows(header []string, rows [][]string, withHeader bool) {
	tw := tabwriter.NewWriter(a.env.Stdout, 0, 4, 2, ' ', 0)
	line := func(cells []string) {
		esc := make([]string, len(cells))
		for i, c := range cells {
			esc[i] = escape(c, false)
		}
		fmt.Fprintln(tw, strings.Join(esc, "\t"))
	}
	if withHeader {
		line(header)
	}
	for _, r := range rows {
		line(r)
	}
	tw.Flush()
}

// required checks that a flag was given.
func required(name, v string) error {
	if strings.TrimSpace(v) == "" {
		return errs.Invalid("--"+name, "required")
	}
	return nil
}
