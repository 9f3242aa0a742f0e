package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// parseTTL reads --ttl: a Go duration from 1m to 24h in whole seconds (R3.2).
func parseTTL(s string) (int32, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, errs.Invalid("--ttl", "want a duration such as 1h or 30m, got %q", s)
	}
	if d%time.Second != 0 || d < tokens.MinTTL || d > tokens.MaxTTL {
		return 0, errs.Invalid("--ttl", "must be whole seconds from 1m to 24h, got %s", s)
	}
	return int32(d / time.Second), nil
}

func (a *app) joinTokensCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "join-tokens", Short: "Mint, list and revoke join tokens for a pool"}
	cmd.AddCommand(a.joinTokensCreateCmd(), a.joinTokensListCmd(), a.joinTokensRevokeCmd())
	return cmd
}

func (a *app) joinTokensCreateCmd() *cobra.Command {
	var (
		tenant, pool, ttl, key, out, hosted string
		maxUses                             int32
		allowReclaim                        bool
		expect                              bcv1.Expect
	)
	create := &cobra.Command{
		Use:   "create --tenant T --pool P --ttl 1h [flags]",
		Short: "Mint a join token; it is shown (or written with --out) once",
		Long: `Mint a join token that lets up to --max-uses machines join the pool within
--ttl. The token (bcjt_jt_….…) is printed once, or written to a new 0600 file
with --out, which never overwrites a file.

--expect-* pin the token to one machine: every identifier named must be among
its hardware claims, or the join is refused without spending a use.

--key makes the call idempotent: the same key again returns the token's record
but never its secret (with --out that is refused: revoke that token and create
a new one).`,
		Example: `  better-compute join-tokens create --tenant $TENANT --pool $POOL --ttl 1h \
    --expect-serial SN-7701 --key adopt-rack-b7-u12 --out ./join-token`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			if err := required("pool", pool); err != nil {
				return err
			}
			secs, err := parseTTL(ttl)
			if err != nil {
				return err
			}
			// The API reads 0 as "the default, 1": refuse it here rather
			// than mint something other than what was asked for.
			if maxUses < 1 {
				return errs.Invalid("--max-uses", "must be at least 1, got %d", maxUses)
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			var f *os.File
			if out != "" {
				// Create the file before minting, so a token is never minted
				// that cannot be saved (an existing file, a missing or
				// read-only directory); it is removed on every failure below.
				f, err = os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
				if errors.Is(err, fs.ErrExist) {
					return errs.New(errs.AlreadyExists, "%s exists; --out never writes over a file", out)
				} else if err != nil {
					return errs.Invalid("--out", "%v", err)
				}
				defer func() {
					if f != nil { // not saved
						f.Close()
						os.Remove(out)
					}
				}()
			}
			res, err := c.JoinTokens.CreateJoinToken(cmd.Context(), connect.NewRequest(&bcv1.CreateJoinTokenRequest{
				TenantId: tenant, PoolId: pool, TtlSeconds: secs, MaxUses: maxUses, Expect: &expect,
				AllowReclaim: allowReclaim, Hosted: hosted, IdempotencyKey: key,
			}))
			if err != nil {
				return err
			}
			t := res.Msg
			if out != "" {
				if err := saveToken(t, f, out, key, tenant, pool); err != nil {
					return err
				}
				f = nil // saved: keep the file
			}
			if a.wantJSON() {
				return a.printJSON(t)
			}
			if err := a.showTokens(t); err != nil {
				return err
			}
			switch {
			case out != "":
				fmt.Fprintf(a.env.Stdout, "\ntoken written to %s (0600); hand it to the machine out of band\n", out)
			case t.Token != "":
				fmt.Fprintf(a.env.Stdout, "\ntoken (shown once): %s\n", t.Token)
			default:
				fmt.Fprintf(a.env.Stdout, "\nthis idempotency key was used before: the token's secret is not shown again\n")
			}
			return nil
		},
	}
	f := create.Flags()
	f.StringVar(&tenant, "tenant", "", "tenant id (tn_…) that owns the pool")
	f.StringVar(&pool, "pool", "", "pool id (pool_…)")
	f.StringVar(&ttl, "ttl", "1h", "lifetime, from 1m to 24h")
	f.Int32Var(&maxUses, "max-uses", 1, "how many machines may join with it")
	f.BoolVar(&allowReclaim, "allow-reclaim", false, "let a known machine with a new key reclaim its node")
	f.StringVar(&expect.ProductUuid, "expect-product-uuid", "", "pin to the machine's product UUID")
	f.StringVar(&expect.Serial, "expect-serial", "", "pin to a product, board or chassis serial")
	f.StringVar(&expect.Mac, "expect-mac", "", "pin to a permanent MAC of a physical NIC")
	f.StringVar(&expect.GpuUuid, "expect-gpu-uuid", "", "pin to a GPU UUID")
	f.StringVar(&hosted, "hosted", "", "kubernetes: for bcd as a DaemonSet (tenant-controlled nodes)")
	f.StringVar(&key, "key", "", "idempotency key: the same key again returns the same token, without its secret")
	f.StringVar(&out, "out", "", "write the token to this new file (0600) instead of printing it")

	return create
}

// saveToken writes a minted token's secret to f, the new --out file, and
// clears it from t (it goes to the file, not the terminal). A token minted
// before (the idempotency key was used) has no secret to save.
func saveToken(t *bcv1.JoinToken, f *os.File, out, key, tenant, pool string) error {
	if t.Token == "" {
		return errs.New(errs.InvalidState, "idempotency key %q was already used for token %s, and its secret is never shown again; revoke it (better-compute join-tokens revoke %s --tenant %s --pool %s) and create a new one", key, t.Id, t.Id, tenant, pool)
	}
	_, werr := f.WriteString(t.Token + "\n")
	if werr == nil {
		werr = f.Sync()
	}
	if werr == nil {
		werr = f.Close()
	}
	if werr != nil {
		return fmt.Errorf("write %s: %w (token %s was minted: revoke it)", out, werr, t.Id)
	}
	t.Token = ""
	return nil
}

func (a *app) joinTokensListCmd() *cobra.Command {
	var lTenant, lPool string
	var all bool
	list := &cobra.Command{
		Use: "list --tenant T --pool P [--all]", Short: "List a pool's tokens (never their secrets)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := (need{"tenant", lTenant, "pool", lPool}).check(); err != nil {
				return err
			}
			items, err := listAll[*bcv1.JoinToken](a, func(c *client.Client, tok string) (*connect.Response[bcv1.ListJoinTokensResponse], error) {
				return c.JoinTokens.ListJoinTokens(cmd.Context(), connect.NewRequest(&bcv1.ListJoinTokensRequest{TenantId: lTenant, PoolId: lPool, IncludeInactive: all, PageSize: 200, PageToken: tok}))
			})
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printTokenList(items)
			}
			return a.showTokens(items...)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&lPool, "pool", "", "pool id (pool_…)")
	list.Flags().BoolVar(&all, "all", false, "include revoked, expired and used-up tokens")

	return list
}

func (a *app) joinTokensRevokeCmd() *cobra.Command {
	var rTenant, rPool string
	revoke := &cobra.Command{
		Use: "revoke TOKEN_ID --tenant T --pool P", Short: "Revoke a token at once (revoking twice is fine)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			// A pasted token must never be sent anywhere as an id.
			if strings.Contains(args[0], ".") {
				return errs.Invalid("TOKEN_ID", "that looks like a token, not a token id: pass the id (jt_…) only; nothing was sent")
			}
			return runCall(a, cmd, need{"tenant", rTenant, "pool", rPool}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.JoinToken], error) {
				return c.JoinTokens.RevokeJoinToken(ctx, connect.NewRequest(&bcv1.RevokeJoinTokenRequest{TenantId: rTenant, PoolId: rPool, TokenId: args[0]}))
			}, one(a.showTokens))
		},
	}
	revoke.Flags().StringVar(&rTenant, "tenant", "", "tenant id (tn_…)")
	revoke.Flags().StringVar(&rPool, "pool", "", "pool id (pool_…)")
	return revoke
}

func (a *app) showTokens(ts ...*bcv1.JoinToken) error {
	var rows [][]string
	for _, t := range ts {
		var ex []string
		e := t.GetExpect()
		for k, v := range map[string]string{"productUuid": e.GetProductUuid(), "serial": e.GetSerial(), "mac": e.GetMac(), "gpuUuid": e.GetGpuUuid()} {
			if v != "" {
				ex = append(ex, k+"="+v)
			}
		}
		expect := strings.Join(sorted(ex), ",")
		if expect == "" {
			expect = "-"
		}
		hosted := t.Hosted
		if hosted == "" {
			hosted = "-"
		}
		role := t.GetRole()
		if role == "" {
			role = "node"
		}
		rows = append(rows, []string{t.Id, t.State, role, fmt.Sprintf("%d/%d", t.UsesLeft, t.MaxUses), fmtTime(t.ExpiresAt), expect, fmt.Sprint(t.AllowReclaim), hosted})
	}
	a.table([]string{"ID", "STATE", "ROLE", "USES LEFT", "EXPIRES", "EXPECT", "RECLAIM", "HOSTED"}, rows)
	return nil
}

// printTokenList prints a list of tokens as JSON without the "token" key:
// a listed token never carries its secret, and an empty "token" on every
// row reads as if it might.
func (a *app) printTokenList(items []*bcv1.JoinToken) error {
	raw, err := stableJSON(&bcv1.ListJoinTokensResponse{Items: items}, "")
	if err != nil {
		return err
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		return err
	}
	if list, ok := doc["items"].([]any); ok {
		for _, it := range list {
			if m, ok := it.(map[string]any); ok {
				delete(m, "token")
			}
		}
	}
	return a.printJSON(doc)
}
