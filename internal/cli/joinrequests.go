package cli

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/cli/client"
	"github.com/better-compute/better-compute/internal/controlplane/joinreq"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
)

// claimsWidth bounds the CLAIMS column of the join request list.
const claimsWidth = 48

// parseApprovalTTL reads approve --ttl: whole seconds from 60 to 86400
// (R3.4).
func parseApprovalTTL(s string) (int32, error) {
	lo, hi := int64(joinreq.MinTTL/time.Second), int64(joinreq.MaxTTL/time.Second)
	if strings.TrimSpace(s) == "" {
		return 0, errs.Invalid("--ttl", "required: how many seconds the approval admits the retry, from %d to %d (e.g. 900)", lo, hi)
	}
	n, err := strconv.ParseInt(s, 10, 32)
	if err != nil || n < lo || n > hi {
		return 0, errs.Invalid("--ttl", "is in seconds, from %d to %d (e.g. 900), got %q", lo, hi, s)
	}
	return int32(n), nil
}

// requestID checks a JOIN_REQUEST_ID argument before anything is sent.
func requestID(s string) error {
	if !ids.Valid(ids.JoinRequest, s) {
		return errs.Invalid("JOIN_REQUEST_ID", "want a join request id jreq_… (from join-requests list); nothing was sent")
	}
	return nil
}

func (a *app) joinRequestsCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "join-requests",
		Short: "List, approve and reject the joins that wait for a person",
		Long: `Some joins wait for a person: a PXE-booted machine nobody expected (the
discovery attestor) or a TPM no allow-list knows. Their attestor records a
join request and the machine's bcd waits. A request shows what the attestor
saw: the claims, hardware key, MAC and IP, the site agent that vouched for
the machine (vouchedBy, bootLeaseEpoch) and the SHA-256 of the CSR the
retry must present.

approve admits exactly one join of that machine, within --ttl seconds; reject
makes its retry fail. Both need a reason, kept in the audit log.`,
	}
	cmd.AddCommand(a.joinRequestsListCmd(), a.joinRequestsApproveCmd(), a.joinRequestsRejectCmd())
	return cmd
}

func (a *app) joinRequestsListCmd() *cobra.Command {
	var lTenant, lPool, lState string
	list := &cobra.Command{
		Use:   "list --tenant T --pool P [--state all]",
		Short: "List a pool's join requests (pending by default)",
		Long: `List a pool's join requests, oldest first: pending ones by default; --state all
for every state, or a comma-separated list of pending, approved, rejected,
consumed and expired (an approval that ran out unused). --json prints every
field of each request.`,
		Example: `  better-compute join-requests list --tenant $TENANT --pool $POOL
  better-compute join-requests list --tenant $TENANT --pool $POOL --state all --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := required("tenant", lTenant); err != nil {
				return err
			}
			if err := required("pool", lPool); err != nil {
				return err
			}
			var states []string
			for _, s := range strings.Split(lState, ",") {
				if s = strings.TrimSpace(s); s != "" {
					states = append(states, s)
				}
			}
			items, err := listAll[*bcv1.JoinRequest](a, func(c *client.Client, tok string) (*connect.Response[bcv1.ListJoinRequestsResponse], error) {
				return c.JoinRequests.ListJoinRequests(cmd.Context(), connect.NewRequest(&bcv1.ListJoinRequestsRequest{TenantId: lTenant, PoolId: lPool,
					State: states, PageSize: 200, PageToken: tok}))
			})
			if err != nil {
				return err
			}
			if a.wantJSON() {
				return a.printJSON(&bcv1.ListJoinRequestsResponse{Items: items})
			}
			var rows [][]string
			for _, r := range items {
				rows = append(rows, []string{r.Id, r.State, r.Attestor, orDash(r.Mac), orDash(r.VouchedBy), fmtTime(r.CreatedAt), oneLine(summary(r.Claims, ""), claimsWidth)})
			}
			a.table([]string{"ID", "STATE", "ATTESTOR", "MAC", "VOUCHED BY", "CREATED", "CLAIMS"}, rows)
			return nil
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&lPool, "pool", "", "pool id (pool_…)")
	list.Flags().StringVar(&lState, "state", "", "all, or states separated by commas (default pending)")
	return list
}

func (a *app) joinRequestsApproveCmd() *cobra.Command {
	var aTenant, aPool, aTTL, aReason string
	approve := &cobra.Command{
		Use:   "approve JOIN_REQUEST_ID --tenant T --pool P --ttl SECONDS --reason TEXT",
		Short: "Admit one join of the machine within --ttl seconds",
		Long: `Approve a pending join request: it admits exactly one join, the machine's
retry with the CSR the request recorded, within --ttl seconds (60 to 86400). bcd, which
keeps retrying while it waits, then finishes the join on its own. A newer
attempt of the machine (another CSR) puts the request back to pending.`,
		Example: `  better-compute join-requests approve jreq_01k5w… --tenant $TENANT --pool $POOL --ttl 900 \
    --reason 'rack B7 intake, ticket 4411'`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.checkDecision(args[0], aTenant, aPool, aReason); err != nil {
				return err
			}
			secs, err := parseApprovalTTL(aTTL)
			if err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.JoinRequests.ApproveJoinRequest(cmd.Context(), connect.NewRequest(&bcv1.ApproveJoinRequestRequest{TenantId: aTenant, PoolId: aPool,
				RequestId: args[0], TtlSeconds: secs, Reason: aReason}))
			if err != nil {
				return err
			}
			return a.showJoinRequest(res.Msg)
		},
	}
	approve.Flags().StringVar(&aTenant, "tenant", "", "tenant id (tn_…)")
	approve.Flags().StringVar(&aPool, "pool", "", "pool id (pool_…)")
	approve.Flags().StringVar(&aTTL, "ttl", "", "seconds the approval admits the retry, 60 to 86400")
	approve.Flags().StringVar(&aReason, "reason", "", "why (kept in the audit log)")
	return approve
}

func (a *app) joinRequestsRejectCmd() *cobra.Command {
	var rTenant, rPool, rReason string
	reject := &cobra.Command{
		Use:   "reject JOIN_REQUEST_ID --tenant T --pool P --reason TEXT",
		Short: "Refuse the machine's join",
		Long: `Reject a pending join request: the machine's retry with that CSR fails, and
bcd stops waiting with an error.`,
		Example: `  better-compute join-requests reject jreq_01k5w… --tenant $TENANT --pool $POOL --reason 'unknown serial'`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.checkDecision(args[0], rTenant, rPool, rReason); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			res, err := c.JoinRequests.RejectJoinRequest(cmd.Context(), connect.NewRequest(&bcv1.RejectJoinRequestRequest{TenantId: rTenant, PoolId: rPool,
				RequestId: args[0], Reason: rReason}))
			if err != nil {
				return err
			}
			return a.showJoinRequest(res.Msg)
		},
	}
	reject.Flags().StringVar(&rTenant, "tenant", "", "tenant id (tn_…)")
	reject.Flags().StringVar(&rPool, "pool", "", "pool id (pool_…)")
	reject.Flags().StringVar(&rReason, "reason", "", "why (kept in the audit log)")
	return reject
}

// checkDecision checks what approve and reject need before anything is
// sent.
func (a *app) checkDecision(id, tenant, pool, reason string) error {
	if err := requestID(id); err != nil {
		return err
	}
	if err := required("tenant", tenant); err != nil {
		return err
	}
	if err := required("pool", pool); err != nil {
		return err
	}
	return required("reason", reason)
}

// showJoinRequest prints one request with every field (R10.2).
func (a *app) showJoinRequest(r *bcv1.JoinRequest) error {
	if a.wantJSON() {
		return a.printJSON(r)
	}
	claims, _ := json.Marshal(r.Claims.AsMap())
	a.table([]string{"FIELD", "VALUE"}, [][]string{
		{"id", r.Id}, {"state", r.State}, {"pool", r.PoolId}, {"site", r.SiteId}, {"attestor", r.Attestor},
		{"hardware key", orDash(r.HardwareKey)}, {"mac", orDash(r.Mac)}, {"ip", orDash(r.Ip)}, {"workflow", orDash(r.WorkflowId)},
		{"vouched by", orDash(r.VouchedBy)}, {"boot lease epoch", fmt.Sprint(r.BootLeaseEpoch)}, {"csr sha256", r.CsrSha256},
		{"claims", string(claims)}, {"created", fmtTime(r.CreatedAt)}, {"decided", fmtTime(r.DecidedAt)}, {"decided by", orDash(r.DecidedBy)},
		{"reason", orDash(r.Reason)}, {"approved until", fmtTime(r.ApprovedUntil)}, {"consumed", fmtTime(r.ConsumedAt)}, {"node", orDash(r.NodeId)},
	})
	return nil
}
