package cli

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

func fmtTime(t *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	return t.AsTime().UTC().Format(time.RFC3339)
}

func (a *app) tenantsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "tenants", Short: "Create and list tenants"}
	create := &cobra.Command{
		Use: "create NAME", Short: "Create a tenant (platform operators only)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, nil, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Tenant], error) {
				return c.Tenants.CreateTenant(ctx, connect.NewRequest(&bcv1.CreateTenantRequest{Name: args[0]}))
			}, one(a.showTenants))
		},
	}
	get := &cobra.Command{
		Use: "get TENANT_ID", Short: "Show a tenant", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, nil, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Tenant], error) {
				return c.Tenants.GetTenant(ctx, connect.NewRequest(&bcv1.GetTenantRequest{TenantId: args[0]}))
			}, one(a.showTenants))
		},
	}
	list := &cobra.Command{
		Use: "list", Short: "List tenants", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, nil, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListTenantsResponse], error) {
				return c.Tenants.ListTenants(ctx, connect.NewRequest(&bcv1.ListTenantsRequest{PageSize: 200, PageToken: tok}))
			}, a.showTenants)
		},
	}
	cmd.AddCommand(create, get, list)
	return cmd
}

func (a *app) showTenants(ts ...*bcv1.Tenant) error {
	if a.wantJSON() && len(ts) == 1 {
		return a.printJSON(ts[0])
	}
	var rows [][]string
	for _, t := range ts {
		rows = append(rows, []string{t.Id, t.Name, fmt.Sprint(t.Root), fmtTime(t.CreatedAt)})
	}
	a.table([]string{"ID", "NAME", "ROOT", "CREATED"}, rows)
	return nil
}

func (a *app) sitesCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "sites", Short: "Create and list sites"}
	var tenant, region string
	create := &cobra.Command{
		Use: "create NAME --tenant T [--region R]", Short: "Create a site (a platform site for the root tenant, a custom site otherwise)", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", tenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Site], error) {
				return c.Sites.CreateSite(ctx, connect.NewRequest(&bcv1.CreateSiteRequest{TenantId: tenant, Name: args[0], Region: region}))
			}, one(a.showSites))
		},
	}
	create.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	create.Flags().StringVar(&region, "region", "", "region label, e.g. eu")
	var gTenant string
	get := &cobra.Command{
		Use: "get SITE_ID --tenant T", Short: "Show a site", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", gTenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Site], error) {
				return c.Sites.GetSite(ctx, connect.NewRequest(&bcv1.GetSiteRequest{TenantId: gTenant, SiteId: args[0]}))
			}, one(a.showSites))
		},
	}
	get.Flags().StringVar(&gTenant, "tenant", "", "tenant id (tn_…)")
	var lTenant string
	list := &cobra.Command{
		Use: "list --tenant T", Short: "List the tenant's sites and the platform's", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, need{"tenant", lTenant}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListSitesResponse], error) {
				return c.Sites.ListSites(ctx, connect.NewRequest(&bcv1.ListSitesRequest{TenantId: lTenant, PageSize: 200, PageToken: tok}))
			}, a.showSites)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	cmd.AddCommand(create, get, list)
	return cmd
}

func (a *app) showSites(ss ...*bcv1.Site) error {
	if a.wantJSON() && len(ss) == 1 {
		return a.printJSON(ss[0])
	}
	var rows [][]string
	for _, s := range ss {
		rows = append(rows, []string{s.Id, s.Name, s.Region, s.OwnerTenantId, fmt.Sprint(s.Custom)})
	}
	a.table([]string{"ID", "NAME", "REGION", "OWNER", "CUSTOM"}, rows)
	return nil
}

type policyFlags struct {
	attestors        []string
	platformOperated bool
	minCPUs, minGPUs int32
	minMemory        string
	approval         string
}

func (p *policyFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringSliceVar(&p.attestors, "join-attestors", nil, "attestors allowed to admit machines (join-token,tpm,discovery,x509pop); empty allows all")
	f.BoolVar(&p.platformOperated, "platform-operated", false, "hosted (Kubernetes) nodes of this platform-owned pool stay platform nodes")
	f.Int32Var(&p.minCPUs, "min-cpus", 0, "acceptance check: minimum CPUs")
	f.Int32Var(&p.minGPUs, "min-gpus", 0, "acceptance check: minimum GPUs")
	f.StringVar(&p.minMemory, "min-memory", "", "acceptance check: minimum memory, e.g. 64GiB")
	f.StringVar(&p.approval, "discovery-approval", "", "which machines a site agent vouched for wait for approval: unknown-machines (default), always or never")
}

func (p *policyFlags) policy() (*bcv1.PoolPolicy, error) {
	out := &bcv1.PoolPolicy{JoinAttestors: p.attestors, Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: p.platformOperated},
		Discovery: &bcv1.DiscoveryPolicy{Approval: p.approval}}
	mem, err := parseBytes(p.minMemory)
	if err != nil {
		return nil, errs.Invalid("--min-memory", "%v", err)
	}
	if p.minCPUs != 0 || p.minGPUs != 0 || mem != 0 {
		out.Acceptance = &bcv1.AcceptancePolicy{MinCpus: p.minCPUs, MinGpus: p.minGPUs, MinMemoryBytes: mem}
	}
	return out, nil
}

func parseBytes(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	units := []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"B", 1}}
	for _, u := range units {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			var v int64
			if _, err := fmt.Sscanf(n, "%d", &v); err != nil || v < 0 || fmt.Sprint(v) != n {
				return 0, fmt.Errorf("want a size like 64GiB")
			}
			return v * u.mult, nil
		}
	}
	return 0, fmt.Errorf("want a size like 64GiB")
}

func (a *app) poolsCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "pools", Short: "Create, list and configure pools"}
	cmd.AddCommand(a.poolsCreateCmd(), a.poolsGetCmd(), a.poolsListCmd(), a.poolsSetPolicyCmd())
	return cmd
}

func (a *app) poolsCreateCmd() *cobra.Command {
	var tenant, site, agent string
	var pf policyFlags
	create := &cobra.Command{
		Use: "create NAME --tenant T --site S [--agent bcd]", Short: "Create a pool on a site", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			if err := required("site", site); err != nil {
				return err
			}
			pol, err := pf.policy()
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Pools.CreatePool(cmd.Context(), connect.NewRequest(&bcv1.CreatePoolRequest{TenantId: tenant, SiteId: site, Name: args[0], Agent: agent, Policy: pol}))
			if err != nil {
				return err
			}
			return a.showPools(res.Msg)
		},
	}
	create.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	create.Flags().StringVar(&site, "site", "", "site id (site_…)")
	create.Flags().StringVar(&agent, "agent", "bcd", "the pool's agent: bcd when machines run the daemon, anything else for none")
	pf.add(create)
	return create
}

func (a *app) poolsGetCmd() *cobra.Command {
	var gTenant string
	get := &cobra.Command{
		Use: "get POOL_ID --tenant T", Short: "Show a pool and its policy", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCall(a, cmd, need{"tenant", gTenant}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.Pool], error) {
				return c.Pools.GetPool(ctx, connect.NewRequest(&bcv1.GetPoolRequest{TenantId: gTenant, PoolId: args[0]}))
			}, one(a.showPools))
		},
	}
	get.Flags().StringVar(&gTenant, "tenant", "", "tenant id (tn_…)")
	return get
}

func (a *app) poolsListCmd() *cobra.Command {
	var lTenant, lSite string
	list := &cobra.Command{
		Use: "list --tenant T [--site S]", Short: "List the tenant's pools", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, need{"tenant", lTenant}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListPoolsResponse], error) {
				return c.Pools.ListPools(ctx, connect.NewRequest(&bcv1.ListPoolsRequest{TenantId: lTenant, SiteId: lSite, PageSize: 200, PageToken: tok}))
			}, a.showPools)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&lSite, "site", "", "only pools of this site")
	return list
}

func (a *app) poolsSetPolicyCmd() *cobra.Command {
	var sTenant string
	var spf policyFlags
	clears := map[string]*bool{}
	setPolicy := &cobra.Command{
		Use:   "set-policy POOL_ID --tenant T [policy flags] [--clear-FLAG...]",
		Short: "Change a pool's policy: only the flags given",
		Long: `Change the policy fields the flags name and keep every other one as it is.
--clear-FLAG removes one field (--clear-join-attestors allows every attestor
again, --clear-min-cpus drops that acceptance check, --clear-acceptance drops
all of them). The change is applied in one transaction on the server, so
concurrent changes of other fields are kept.`,
		Example: `  better-compute pools set-policy $POOL --tenant $TENANT --min-gpus 8
  better-compute pools set-policy $POOL --tenant $TENANT --clear-min-memory --join-attestors join-token,tpm`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", sTenant); err != nil {
				return err
			}
			pol, err := spf.policy()
			if err != nil {
				return err
			}
			// Every flag given, set or cleared, names a field of the mask.
			var paths []string
			for _, f := range policyFields {
				set := f.flag != "" && cmd.Flags().Changed(f.flag)
				clear := *clears[f.clear]
				if set && clear {
					return errs.Invalid("--"+f.clear, "--%s and --%s contradict each other", f.flag, f.clear)
				}
				if set || clear {
					paths = append(paths, f.path)
				}
			}
			if len(paths) == 0 {
				return errs.Invalid("set-policy", "nothing to change: give a policy flag or a --clear-… flag")
			}
			if *clears["clear-acceptance"] {
				for _, f := range policyFields {
					if strings.HasPrefix(f.path, "acceptance.") && slices.Contains(paths, f.path) {
						return errs.Invalid("--clear-acceptance", "drops every acceptance check; it cannot be combined with --%s or --%s", f.flag, f.clear)
					}
				}
			}
			// Cleared fields are sent at their zero value.
			if pol.Acceptance == nil {
				pol.Acceptance = &bcv1.AcceptancePolicy{}
			}
			if *clears["clear-acceptance"] {
				pol.Acceptance = nil
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.Pools.UpdatePoolPolicy(cmd.Context(), connect.NewRequest(&bcv1.UpdatePoolPolicyRequest{
				TenantId: sTenant, PoolId: args[0], Policy: pol, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}}))
			if err != nil {
				return err
			}
			return a.showPools(res.Msg)
		},
	}
	setPolicy.Flags().StringVar(&sTenant, "tenant", "", "tenant id (tn_…)")
	spf.add(setPolicy)
	for _, f := range policyFields {
		if _, ok := clears[f.clear]; ok {
			continue
		}
		clears[f.clear] = new(bool)
		setPolicy.Flags().BoolVar(clears[f.clear], f.clear, false, f.clearHelp)
	}
	return setPolicy
}

// policyFields maps set-policy's flags to the update mask's paths: a flag given changes its field; --clear-FLAG clears it; any
// other field is kept.
var policyFields = []struct {
	flag, clear, path, clearHelp string
}{
	{"join-attestors", "clear-join-attestors", "join_attestors", "allow every attestor again"},
	{"platform-operated", "clear-platform-operated", "kubernetes.platform_operated", "hosted nodes of this pool become tenant nodes again"},
	{"min-cpus", "clear-min-cpus", "acceptance.min_cpus", "drop the minimum-CPUs acceptance check"},
	{"min-gpus", "clear-min-gpus", "acceptance.min_gpus", "drop the minimum-GPUs acceptance check"},
	{"min-memory", "clear-min-memory", "acceptance.min_memory_bytes", "drop the minimum-memory acceptance check"},
	{"", "clear-acceptance", "acceptance", "drop every acceptance check"},
	{"discovery-approval", "clear-discovery-approval", "discovery.approval", "back to the default discovery approval (unknown-machines)"},
}

func (a *app) showPools(ps ...*bcv1.Pool) error {
	if a.wantJSON() && len(ps) == 1 {
		return a.printJSON(ps[0])
	}
	var rows [][]string
	for _, p := range ps {
		att := strings.Join(p.GetPolicy().GetJoinAttestors(), ",")
		if att == "" {
			att = "any"
		}
		rows = append(rows, []string{p.Id, p.Name, p.SiteId, p.Agent, att, fmt.Sprint(p.GetPolicy().GetKubernetes().GetPlatformOperated()), fmt.Sprint(p.GetPolicy().GetAcceptance() != nil)})
	}
	a.table([]string{"ID", "NAME", "SITE", "AGENT", "ATTESTORS", "PLATFORM-OPERATED", "ACCEPTANCE"}, rows)
	return nil
}

func (a *app) apiKeysCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "api-keys", Short: "Create, list and revoke API keys"}
	var tenant string
	var grants []string
	var ttl time.Duration
	create := &cobra.Command{
		Use:   "create NAME --tenant T --grant ACTION=RESOURCE...",
		Short: "Create an API key; its secret is printed once",
		Long: `Create an API key for a new principal in the tenant. Each --grant is
ACTION=RESOURCE, e.g. compute:join-tokens:*=compute-pool/pool_… or *=* for
everything the tenant may do. A key cannot grant more than its creator holds.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", tenant); err != nil {
				return err
			}
			req := &bcv1.CreateApiKeyRequest{TenantId: tenant, Name: args[0], TtlSeconds: int64(ttl / time.Second)}
			for _, g := range grants {
				act, res, ok := strings.Cut(g, "=")
				if !ok {
					return errs.Invalid("--grant", "want ACTION=RESOURCE, got %q", g)
				}
				req.Grants = append(req.Grants, &bcv1.Grant{Action: act, Resource: res})
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.APIKeys.CreateApiKey(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(res.Msg)
			}
			if err := a.showKeys(res.Msg.ApiKey); err != nil {
				return err
			}
			fmt.Fprintf(a.env.Stdout, "\nkey (shown once): %s\n", res.Msg.Key)
			return nil
		},
	}
	create.Flags().StringVar(&tenant, "tenant", "", "tenant id (tn_…)")
	create.Flags().StringArrayVar(&grants, "grant", nil, "ACTION=RESOURCE (repeatable)")
	create.Flags().DurationVar(&ttl, "ttl", 0, "expire the key after this long (default: never)")

	var lTenant string
	list := &cobra.Command{
		Use: "list --tenant T", Short: "List API keys (never their secrets)", Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runList(a, cmd, need{"tenant", lTenant}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListApiKeysResponse], error) {
				return c.APIKeys.ListApiKeys(ctx, connect.NewRequest(&bcv1.ListApiKeysRequest{TenantId: lTenant, PageSize: 200, PageToken: tok}))
			}, a.showKeys)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")

	var rTenant string
	revoke := &cobra.Command{
		Use: "revoke KEY_ID --tenant T", Short: "Revoke an API key", Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", rTenant); err != nil {
				return err
			}
			if strings.Contains(args[0], ".") {
				return errs.Invalid("KEY_ID", "that looks like a key secret; pass the key id (key_…) only")
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			if _, err := c.APIKeys.RevokeApiKey(cmd.Context(), connect.NewRequest(&bcv1.RevokeApiKeyRequest{TenantId: rTenant, ApiKeyId: args[0]})); err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(map[string]string{"id": args[0], "state": "revoked"})
			}
			fmt.Fprintf(a.env.Stdout, "revoked %s\n", args[0])
			return nil
		},
	}
	revoke.Flags().StringVar(&rTenant, "tenant", "", "tenant id (tn_…)")
	cmd.AddCommand(create, list, revoke)
	return cmd
}

func (a *app) showKeys(ks ...*bcv1.ApiKey) error {
	var rows [][]string
	for _, k := range ks {
		var gs []string
		for _, g := range k.Grants {
			gs = append(gs, g.Action+"="+g.Resource)
		}
		state := "live"
		if k.RevokedAt != nil {
			state = "revoked"
		}
		rows = append(rows, []string{k.Id, k.Name, state, fmtTime(k.ExpiresAt), strings.Join(gs, " ")})
	}
	a.table([]string{"ID", "NAME", "STATE", "EXPIRES", "GRANTS"}, rows)
	return nil
}
