package api

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

func ts(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func tsp(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

func jsonStruct(b []byte) *structpb.Struct {
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil || m == nil {
		return &structpb.Struct{}
	}
	s, err := structpb.NewStruct(m)
	if err != nil {
		return &structpb.Struct{}
	}
	return s
}

// EventPB is an event as ListEvents answers it, its id and cursor sealed
// for its tenant (R14.3). The audit export writes the same (export).
func EventPB(c *events.Codec, e store.Event) *bcv1.Event {
	id := c.EventCursor(e.TenantID, e.TxOrder, e.ID)
	return &bcv1.Event{Id: id, TenantId: e.TenantID, Type: e.Type, Subject: e.Subject,
		Time: ts(e.CreatedAt), Data: jsonStruct(e.Data), Cursor: id}
}

// AuditPB is an audit row as ListAudit answers it, as EventPB.
func AuditPB(c *events.Codec, a store.AuditEntry) *bcv1.AuditEntry {
	id := c.AuditCursor(a.TenantID, a.ID)
	return &bcv1.AuditEntry{Id: id, TenantId: a.TenantID, Actor: a.Actor, Action: a.Action,
		Resource: a.Resource, Time: ts(a.CreatedAt), Data: jsonStruct(a.Data), Cursor: id}
}

func tenantPB(t store.Tenant, root string) *bcv1.Tenant {
	return &bcv1.Tenant{Id: t.ID, Name: t.Name, Root: t.ID == root, CreatedAt: ts(t.CreatedAt)}
}

func sitePB(s store.Site) *bcv1.Site {
	return &bcv1.Site{Id: s.ID, OwnerTenantId: s.OwnerTenantID, Name: s.Name, Region: s.Region, Custom: s.Custom, CreatedAt: ts(s.CreatedAt)}
}

func policyPB(p tenancy.Policy) *bcv1.PoolPolicy {
	out := &bcv1.PoolPolicy{JoinAttestors: p.JoinAttestors, Kubernetes: &bcv1.KubernetesPolicy{PlatformOperated: p.Kubernetes.PlatformOperated},
		Discovery: &bcv1.DiscoveryPolicy{Approval: p.ApprovalMode()}}
	if a := p.Acceptance; a != nil {
		out.Acceptance = &bcv1.AcceptancePolicy{MinCpus: int32(a.MinCPUs), MinMemoryBytes: a.MinMemoryBytes, MinGpus: int32(a.MinGPUs)}
	}
	return out
}

func policyFromPB(p *bcv1.PoolPolicy) tenancy.Policy {
	var out tenancy.Policy
	if p == nil {
		return out
	}
	out.JoinAttestors = p.GetJoinAttestors()
	out.Kubernetes.PlatformOperated = p.GetKubernetes().GetPlatformOperated()
	out.Discovery.Approval = p.GetDiscovery().GetApproval()
	if a := p.GetAcceptance(); a != nil {
		out.Acceptance = &tenancy.Acceptance{MinCPUs: int(a.GetMinCpus()), MinMemoryBytes: a.GetMinMemoryBytes(), MinGPUs: int(a.GetMinGpus())}
	}
	return out
}

func poolPB(p store.Pool) *bcv1.Pool {
	pol, _ := tenancy.ParsePolicy(p.Policy)
	return &bcv1.Pool{Id: p.ID, SiteId: p.SiteID, OwnerTenantId: p.OwnerTenantID, Name: p.Name, Agent: p.Agent, Policy: policyPB(pol),
		CreatedAt: ts(p.CreatedAt), UpdatedAt: ts(p.UpdatedAt)}
}

func grantsPB(b []byte) []*bcv1.Grant {
	var gs []authz.Grant
	_ = json.Unmarshal(b, &gs)
	out := make([]*bcv1.Grant, 0, len(gs))
	for _, g := range gs {
		out = append(out, &bcv1.Grant{Action: g.Action, Resource: g.Resource})
	}
	return out
}

func apiKeyPB(k store.APIKeyRow) *bcv1.ApiKey {
	return &bcv1.ApiKey{Id: k.ID, TenantId: k.TenantID, Name: k.Name, Grants: grantsPB(k.Grants), CreatedAt: ts(k.CreatedAt),
		ExpiresAt: tsp(k.ExpiresAt), RevokedAt: tsp(k.RevokedAt)}
}

func expectPB(e hwid.Expect) *bcv1.Expect {
	return &bcv1.Expect{ProductUuid: e.ProductUUID, Serial: e.Serial, Mac: e.MAC, GpuUuid: e.GPUUUID}
}

func joinTokenPB(t store.JoinToken) *bcv1.JoinToken {
	e, _ := tokens.Expect(t)
	return &bcv1.JoinToken{Id: t.ID, PoolId: t.PoolID, SiteId: t.SiteID, Role: t.Role, UsesLeft: int32(t.UsesLeft), MaxUses: int32(t.MaxUses),
		Expect: expectPB(e), AllowReclaim: t.AllowReclaim, Hosted: t.Hosted, ExpiresAt: ts(t.ExpiresAt), CreatedAt: ts(t.CreatedAt),
		RevokedAt: tsp(t.RevokedAt), State: tokens.State(t)}
}

// page turns a request's page size into a limit: 0 is 100, above 200 is 200.
func page(field string, size int32) (int, error) {
	switch {
	case size < 0:
		return 0, errs.Invalid(field, "cannot be negative")
	case size == 0:
		return 100, nil
	case size > 200:
		return 200, nil
	}
	return int(size), nil
}

// pageToken checks a page token (the last id of the previous page).
func pageToken(tok string) (string, error) {
	if len(tok) > 64 {
		return "", errs.Invalid("pageToken", "not a page token from this API")
	}
	return tok, nil
}

// pageArgs reads a list request's page size and token.
func pageArgs(size int32, token string) (limit int, after string, err error) {
	if limit, err = page("pageSize", size); err != nil {
		return 0, "", err
	}
	after, err = pageToken(token)
	return limit, after, err
}

// next returns the token for the page after items when the page was full.
func next[T any](items []T, limit int, id func(T) string) string {
	if len(items) < limit || len(items) == 0 {
		return ""
	}
	return id(items[len(items)-1])
}

// Policy field paths of UpdatePoolPolicyRequest.update_mask (proto names).
const (
	maskJoinAttestors    = "join_attestors"
	maskKubernetes       = "kubernetes"
	maskPlatformOperated = "kubernetes.platform_operated"
	maskAcceptance       = "acceptance"
	maskMinCPUs          = "acceptance.min_cpus"
	maskMinMemory        = "acceptance.min_memory_bytes"
	maskMinGPUs          = "acceptance.min_gpus"
	maskDiscovery        = "discovery"
	maskApproval         = "discovery.approval"
)

var policyMaskPaths = []string{maskJoinAttestors, maskKubernetes, maskPlatformOperated, maskAcceptance, maskMinCPUs, maskMinMemory, maskMinGPUs, maskDiscovery, maskApproval}

// checkPolicyMask refuses an unknown or repeated path.
func checkPolicyMask(paths []string) error {
	if len(paths) > len(policyMaskPaths) {
		return errs.Invalid("updateMask", "at most %d paths", len(policyMaskPaths))
	}
	seen := map[string]bool{}
	for _, p := range paths {
		if !slices.Contains(policyMaskPaths, p) {
			return errs.Invalid("updateMask", "unknown policy field %q (want one of %s)", p, strings.Join(policyMaskPaths, ", "))
		}
		if seen[p] {
			return errs.Invalid("updateMask", "%q named twice", p)
		}
		seen[p] = true
	}
	for _, p := range paths {
		if parent, _, ok := strings.Cut(p, "."); ok && seen[parent] {
			return errs.Invalid("updateMask", "%q and %q overlap: name one", parent, p)
		}
	}
	return nil
}

// mergePolicy returns old with each masked field taken from req (an unset
// value clears the field). Acceptance checks whose minimums all end at
// zero are removed: a pool without minimums runs no acceptance.
func mergePolicy(old tenancy.Policy, req *bcv1.PoolPolicy, paths []string) tenancy.Policy {
	out := old
	out.JoinAttestors = slices.Clone(old.JoinAttestors)
	acc := tenancy.Acceptance{}
	if old.Acceptance != nil {
		acc = *old.Acceptance
	}
	touchedAcceptance := false
	for _, p := range paths {
		switch p {
		case maskJoinAttestors:
			out.JoinAttestors = slices.Clone(req.GetJoinAttestors())
		case maskKubernetes, maskPlatformOperated:
			out.Kubernetes.PlatformOperated = req.GetKubernetes().GetPlatformOperated()
		case maskAcceptance:
			acc, touchedAcceptance = tenancy.Acceptance{}, true
			if a := req.GetAcceptance(); a != nil {
				acc = tenancy.Acceptance{MinCPUs: int(a.GetMinCpus()), MinMemoryBytes: a.GetMinMemoryBytes(), MinGPUs: int(a.GetMinGpus())}
				out.Acceptance = &acc
			} else {
				out.Acceptance = nil
			}
		case maskDiscovery, maskApproval:
			out.Discovery.Approval = req.GetDiscovery().GetApproval()
		case maskMinCPUs:
			acc.MinCPUs, touchedAcceptance = int(req.GetAcceptance().GetMinCpus()), true
		case maskMinMemory:
			acc.MinMemoryBytes, touchedAcceptance = req.GetAcceptance().GetMinMemoryBytes(), true
		case maskMinGPUs:
			acc.MinGPUs, touchedAcceptance = int(req.GetAcceptance().GetMinGpus()), true
		}
	}
	if touchedAcceptance && !slices.Contains(paths, maskAcceptance) {
		if acc == (tenancy.Acceptance{}) {
			out.Acceptance = nil
		} else {
			out.Acceptance = &acc
		}
	}
	return out
}

// listed is one page of a List call's answer: the items converted for the
// wire and the token of the next page ("" on the last).
type listed[P any] struct {
	items []P
	next  string
}

// listPage is every List method's plumbing: the caller's principal, the
// page arguments, one read of the domain service (fetch), and the items
// converted with pb, the next page token taken from the last item's id.
func listPage[T, P any](ctx context.Context, size int32, token string, fetch func(p authz.Principal, after string, limit int) ([]T, error),
	id func(T) string, pb func(T) P) (listed[P], error) {
	p, err := principal(ctx)
	if err != nil {
		return listed[P]{}, err
	}
	limit, after, err := pageArgs(size, token)
	if err != nil {
		return listed[P]{}, err
	}
	items, err := fetch(p, after, limit)
	if err != nil {
		return listed[P]{}, err
	}
	out := listed[P]{items: make([]P, 0, len(items)), next: next(items, limit, id)}
	for _, it := range items {
		out.items = append(out.items, pb(it))
	}
	return out, nil
}
