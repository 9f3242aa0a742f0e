package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/client"
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
join request and the machine's bcd waits. A request shows the machine's
claims (and the hardware key derived from them: what the machine says about
itself) apart from the attestor's evidence (what it established: for tpm the
EK's SHA-256, its certificate's standing and the AK name; for discovery the
site agent that vouched, its boot lease and the address it leased, and the
address the join came from), and its effect: a new node, or the reclaim of
an existing node, shown as recorded.

approve admits exactly one join of that machine, within --ttl seconds; a
reclaim needs --reclaim naming the node it takes. reject makes its retry
fail. Both need a reason, kept in the audit log.`,
	}
	cmd.AddCommand(a.joinRequestsListCmd(), a.joinRequestsShowCmd(), a.joinRequestsApproveCmd(), a.joinRequestsRejectCmd())
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
			var states []string
			for _, s := range strings.Split(lState, ",") {
				if s = strings.TrimSpace(s); s != "" {
					states = append(states, s)
				}
			}
			return runList(a, cmd, need{"tenant", lTenant, "pool", lPool}, func(ctx context.Context, c *client.Client, tok string) (*connect.Response[bcv1.ListJoinRequestsResponse], error) {
				return c.JoinRequests.ListJoinRequests(ctx, connect.NewRequest(&bcv1.ListJoinRequestsRequest{TenantId: lTenant, PoolId: lPool,
					State: states, PageSize: 200, PageToken: tok}))
			}, a.showJoinRequests)
		},
	}
	list.Flags().StringVar(&lTenant, "tenant", "", "tenant id (tn_…)")
	list.Flags().StringVar(&lPool, "pool", "", "pool id (pool_…)")
	list.Flags().StringVar(&lState, "state", "", "all, or states separated by commas (default pending)")
	return list
}

func (a *app) joinRequestsShowCmd() *cobra.Command {
	var sTenant, sPool string
	show := &cobra.Command{
		Use:   "show JOIN_REQUEST_ID --tenant T --pool P",
		Short: "Show one join request: evidence, claims, effect and version",
		Long: `Show one join request with every field: the attestor's evidence apart from
the machine's claims, what approving it does (a new node, or the node it
reclaims, with that node's serials, MACs and hardware key beside the
request's), and its version, which approve --version binds to.`,
		Example: `  better-compute join-requests show jreq_01k5w… --tenant $TENANT --pool $POOL`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := requestID(args[0]); err != nil {
				return err
			}
			return runCall(a, cmd, need{"tenant", sTenant, "pool", sPool}, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.JoinRequest], error) {
				return c.JoinRequests.GetJoinRequest(ctx, connect.NewRequest(&bcv1.GetJoinRequestRequest{TenantId: sTenant, PoolId: sPool, RequestId: args[0]}))
			}, a.showJoinRequest)
		},
	}
	show.Flags().StringVar(&sTenant, "tenant", "", "tenant id (tn_…)")
	show.Flags().StringVar(&sPool, "pool", "", "pool id (pool_…)")
	return show
}

// hexWidth is how many hex digits of a hash the list table shows.
const hexWidth = 16

// shortHex cuts a hex hash for a table cell.
func shortHex(h string) string {
	if len(h) > hexWidth {
		return h[:hexWidth] + "…"
	}
	return h
}

// evidenceSummary is the list table's EVIDENCE cell (R22.1): what the
// attestor established, never the machine's claims.
func evidenceSummary(r *bcv1.JoinRequest) string {
	e := r.GetEvidence()
	var parts []string
	if e.GetEkSha256() != "" {
		cert := "no ek cert"
		switch {
		case e.GetEkCertificateTrusted():
			cert = "ek cert trusted"
		case e.GetEkCertificatePresent():
			cert = "ek cert untrusted"
		}
		parts = append(parts, "ek "+shortHex(e.GetEkSha256()), cert)
	}
	if e.GetVouchedBy() != "" {
		parts = append(parts, fmt.Sprintf("vouched by %s lease %d ip %s", e.GetVouchedBy(), e.GetBootLeaseEpoch(), orDash(e.GetVouchedIp())))
	}
	if e.GetPeerAddress() != "" {
		parts = append(parts, "peer "+e.GetPeerAddress())
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ", ")
}

// effectSummary is the list table's EFFECT cell (R22.2).
func effectSummary(r *bcv1.JoinRequest) string {
	e := r.GetEffect()
	var s string
	switch n := e.GetNode(); e.GetKind() {
	case "reclaim":
		s = fmt.Sprintf("RECLAIM %s (%s, gen %d, seen %s)", n.GetId(), orDash(n.GetRole()), n.GetIdentityGeneration(), fmtTime(n.GetLastSeenAt()))
	case "bind":
		s = "bind " + n.GetId()
	case "":
		s = "-"
	default:
		s = "new node"
	}
	switch ids := e.GetSameClaimsRequestIds(); {
	case len(ids) == 1:
		s += "; SAME CLAIMS as " + ids[0]
	case len(ids) > 1:
		s += fmt.Sprintf("; SAME CLAIMS as %s and %d more", ids[0], len(ids)-1)
	}
	return s
}

func (a *app) joinRequestsApproveCmd() *cobra.Command {
	var aTenant, aPool, aTTL, aReason, aReclaim, aVersion string
	approve := &cobra.Command{
		Use:   "approve JOIN_REQUEST_ID --tenant T --pool P --ttl SECONDS --reason TEXT",
		Short: "Admit one join of the machine within --ttl seconds",
		Long: `Approve a pending join request: it admits exactly one join, the machine's
retry with the CSR the request recorded, within --ttl seconds (60 to 86400). bcd, which
keeps retrying while it waits, then finishes the join on its own. A newer
attempt of the machine (another CSR) puts the request back to pending.

A request whose effect is a reclaim makes the machine an existing node: the
node's identity generation goes up and its certificates are revoked. It is
approved only with --reclaim naming that node (see join-requests show).

The approval is bound to the request's version: --version as listed or shown
(--json), else the version approve reads just before it sends. A request
refreshed since (a new CSR, new evidence) is refused with CONFLICT: show it
again and review it.`,
		Example: `  better-compute join-requests approve jreq_01k5w… --tenant $TENANT --pool $POOL --ttl 900 \
    --reason 'rack B7 intake, ticket 4411'
  better-compute join-requests approve jreq_01k5w… --tenant $TENANT --pool $POOL --ttl 900 \
    --reason 'disk replaced, ticket 4420' --reclaim node_01k5v… --version v1-…`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := a.checkDecision(args[0], aTenant, aPool, aReason); err != nil {
				return err
			}
			secs, err := parseApprovalTTL(aTTL)
			if err != nil {
				return err
			}
			if aReclaim != "" && !ids.Valid(ids.Node, aReclaim) {
				return errs.Invalid("--reclaim", "want the node id node_… the request reclaims; nothing was sent")
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			if aVersion == "" {
				// R22.2: bind the approval to the request as it is now, and
				// refuse a reclaim not acknowledged before sending anything.
				got, err := c.JoinRequests.GetJoinRequest(cmd.Context(), connect.NewRequest(&bcv1.GetJoinRequestRequest{TenantId: aTenant, PoolId: aPool, RequestId: args[0]}))
				if err != nil {
					return err
				}
				if eff := got.Msg.GetEffect(); eff.GetKind() == "reclaim" && aReclaim == "" {
					return errs.New(errs.InvalidState, "join request %s reclaims node %s: approving it makes this machine that node and revokes its certificates; review it (join-requests show) and pass --reclaim %s; nothing was sent",
						args[0], eff.GetNode().GetId(), eff.GetNode().GetId())
				}
				aVersion = got.Msg.GetVersion()
			}
			res, err := c.JoinRequests.ApproveJoinRequest(cmd.Context(), connect.NewRequest(&bcv1.ApproveJoinRequestRequest{TenantId: aTenant, PoolId: aPool,
				RequestId: args[0], TtlSeconds: secs, Reason: aReason, Version: aVersion, AcknowledgeReclaimNodeId: aReclaim}))
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
	approve.Flags().StringVar(&aReclaim, "reclaim", "", "the node (node_…) the request reclaims: acknowledges the takeover")
	approve.Flags().StringVar(&aVersion, "version", "", "the request's version as reviewed (list --json or show); default: as read now")
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
			return runCall(a, cmd, nil, func(ctx context.Context, c *client.Client) (*connect.Response[bcv1.JoinRequest], error) {
				return c.JoinRequests.RejectJoinRequest(ctx, connect.NewRequest(&bcv1.RejectJoinRequestRequest{TenantId: rTenant, PoolId: rPool,
					RequestId: args[0], Reason: rReason}))
			}, a.showJoinRequest)
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
	return need{"tenant", tenant, "pool", pool, "reason", reason}.check()
}

func (a *app) showJoinRequests(rs ...*bcv1.JoinRequest) error {
	var rows [][]string
	for _, r := range rs {
		rows = append(rows, []string{r.Id, r.State, r.Attestor, evidenceSummary(r), effectSummary(r), fmtTime(r.CreatedAt),
			oneLine(summary(r.Claims, ""), claimsWidth)})
	}
	a.table([]string{"ID", "STATE", "ATTESTOR", "EVIDENCE", "EFFECT", "CREATED", "CLAIMS"}, rows)
	return nil
}

// showJoinRequest prints one request with every field (R10.2).
func (a *app) showJoinRequest(r *bcv1.JoinRequest) error {
	if a.wantJSON() {
		return a.printJSON(r)
	}
	claims, _ := json.Marshal(r.Claims.AsMap())
	ev := r.GetEvidence()
	rows := [][]string{
		{"id", r.Id}, {"version", orDash(r.Version)}, {"state", r.State}, {"pool", r.PoolId}, {"site", r.SiteId}, {"attestor", r.Attestor},
		{"evidence: ek sha256", orDash(ev.GetEkSha256())}, {"evidence: ek certificate", ekCertText(ev)},
		{"evidence: ak name", orDash(ev.GetAkName())}, {"evidence: vouched by", orDash(ev.GetVouchedBy())},
		{"evidence: boot lease epoch", fmt.Sprint(ev.GetBootLeaseEpoch())}, {"evidence: vouched ip", orDash(ev.GetVouchedIp())},
		{"evidence: vouched mac", orDash(ev.GetVouchedMac())}, {"evidence: workflow", orDash(ev.GetWorkflowId())},
		{"evidence: peer address", orDash(ev.GetPeerAddress())},
		{"claims", string(claims)}, {"claims: hardware key", orDash(r.HardwareKey)}, {"csr sha256", r.CsrSha256},
		{"effect", effectSummary(r)}, {"same claims as", orDash(strings.Join(r.GetEffect().GetSameClaimsRequestIds(), ", "))},
	}
	if n := r.GetEffect().GetNode(); n.GetId() != "" {
		rows = append(rows, [][]string{{"node: state", orDash(n.GetState())}, {"node: hostname", orDash(n.GetHostname())},
			{"node: product uuid", orDash(n.GetProductUuid())}, {"node: serials", orDash(strings.Join(n.GetSerials(), ", "))},
			{"node: macs", orDash(strings.Join(n.GetMacs(), ", "))}, {"node: hardware key", orDash(n.GetHardwareKey())},
			{"node: attestor", orDash(n.GetAttestor())}}...)
	}
	rows = append(rows, [][]string{{"created", fmtTime(r.CreatedAt)}, {"updated", fmtTime(r.UpdatedAt)}, {"decided", fmtTime(r.DecidedAt)},
		{"decided by", orDash(r.DecidedBy)}, {"reason", orDash(r.Reason)}, {"acknowledged reclaim", orDash(r.AcknowledgedReclaimNodeId)},
		{"approved until", fmtTime(r.ApprovedUntil)}, {"consumed", fmtTime(r.ConsumedAt)}, {"node", orDash(r.NodeId)}}...)
	a.table([]string{"FIELD", "VALUE"}, rows)
	return nil
}

// ekCertText tells an EK certificate's standing, with its subject and
// issuer.
func ekCertText(e *bcv1.JoinRequestEvidence) string {
	switch {
	case e.GetEkSha256() == "":
		return "-"
	case !e.GetEkCertificatePresent():
		return "none sent"
	}
	standing := "untrusted (chains to no manufacturer CA the server trusts)"
	if e.GetEkCertificateTrusted() {
		standing = "trusted (chains to a manufacturer CA)"
	}
	return fmt.Sprintf("%s; subject %q, issuer %q", standing, e.GetEkCertificateSubject(), e.GetEkCertificateIssuer())
}
