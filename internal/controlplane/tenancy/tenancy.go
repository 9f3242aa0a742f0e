// Package tenancy owns tenants, sites and pools: who owns what, the
// deployment's root tenant, and pool policy (which attestors may admit
// machines, whether a Kubernetes pool is platform-operated, acceptance
// checks).
package tenancy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/ids"
	"github.com/better-compute/better-compute/internal/shared/wire"
)

// AgentBCD is the agent of pools whose machines run the daemon.
const AgentBCD = "bcd"

// Attestors a pool policy may name.
var Attestors = wire.Attestors

// Policy is a pool's policy.
type Policy struct {
	// JoinAttestors lists the attestors that may admit machines; empty
	// allows every attestor.
	JoinAttestors []string   `json:"joinAttestors,omitempty"`
	Kubernetes    Kubernetes `json:"kubernetes,omitzero"`
	// Acceptance checks run on a node after its first Hello; nil: none.
	Acceptance *Acceptance `json:"acceptance,omitempty"`
	// Discovery is how the discovery attestor admits vouched machines.
	Discovery Discovery `json:"discovery,omitzero"`
}

// Discovery approval modes (R10.4): which machines a site agent vouched for
// still wait for a person. In every mode a machine that is already a node
// of the tenant waits (R15.3: a vouch proves a boot, not which machine's
// claims came with it, so only a person lets a ramdisk reclaim a node).
const (
	// ApprovalUnknownMachines defers machines without a trusted hardware
	// key that matches a node of the tenant, and, like every mode, those
	// with one. The default.
	ApprovalUnknownMachines = "unknown-machines"
	// ApprovalAlways defers every machine.
	ApprovalAlways = "always"
	// ApprovalNever admits a vouched machine that is not yet a node.
	ApprovalNever = "never"
)

// Discovery is the discovery attestor's part of a pool policy.
type Discovery struct {
	// Approval is one of the approval modes; empty means
	// ApprovalUnknownMachines.
	Approval string `json:"approval,omitempty"`
}

// ApprovalMode is the pool's discovery approval mode, defaults applied.
func (p Policy) ApprovalMode() string {
	if p.Discovery.Approval == "" {
		return ApprovalUnknownMachines
	}
	return p.Discovery.Approval
}

// Kubernetes is the hosted-cluster part of a pool policy.
type Kubernetes struct {
	PlatformOperated bool `json:"platformOperated,omitempty"`
}

// Acceptance lists the built-in acceptance checks.
type Acceptance struct {
	MinCPUs        int   `json:"minCpus,omitempty"`
	MinMemoryBytes int64 `json:"minMemoryBytes,omitempty"`
	MinGPUs        int   `json:"minGpus,omitempty"`
}

// AllowsAttestor reports whether the policy lets attestor admit machines.
func (p Policy) AllowsAttestor(attestor string) bool {
	return len(p.JoinAttestors) == 0 || slices.Contains(p.JoinAttestors, attestor)
}

// Validate checks a policy.
func (p Policy) Validate() error {
	seen := map[string]bool{}
	for i, a := range p.JoinAttestors {
		if !slices.Contains(Attestors, a) {
			return errs.Invalid(fmt.Sprintf("policy.joinAttestors[%d]", i), "unknown attestor %q (want one of %v)", a, Attestors)
		}
		if seen[a] {
			return errs.Invalid(fmt.Sprintf("policy.joinAttestors[%d]", i), "%q listed twice", a)
		}
		seen[a] = true
	}
	switch p.Discovery.Approval {
	case "", ApprovalUnknownMachines, ApprovalAlways, ApprovalNever:
	default:
		return errs.Invalid("policy.discovery.approval", "unknown approval mode %q (want %s, %s or %s)", p.Discovery.Approval, ApprovalUnknownMachines, ApprovalAlways, ApprovalNever)
	}
	if a := p.Acceptance; a != nil {
		if a.MinCPUs < 0 || a.MinMemoryBytes < 0 || a.MinGPUs < 0 {
			return errs.Invalid("policy.acceptance", "minimums cannot be negative")
		}
	}
	return nil
}

// ParsePolicy decodes a stored policy.
func ParsePolicy(b []byte) (Policy, error) {
	var p Policy
	if len(b) == 0 {
		return p, nil
	}
	if err := json.Unmarshal(b, &p); err != nil {
		return p, fmt.Errorf("parse pool policy: %w", err)
	}
	return p, nil
}

// Service manages tenants, sites and pools.
type Service struct {
	db  *store.DB
	hub *events.Hub
}

// Config lists the Service's dependencies.
type Config struct {
	DB  *store.DB
	Hub *events.Hub
}

// New returns a Service.
func New(cfg Config) *Service { return &Service{db: cfg.DB, hub: cfg.Hub} }

func notFound(kind, id string) error { return errs.New(errs.NotFound, "%s %s not found", kind, id) }

// Bootstrap makes sure the deployment has a root tenant named name and
// returns it; created tells whether this call made it.
func (s *Service) Bootstrap(ctx context.Context, name string) (t store.Tenant, created bool, err error) {
	if err := authz.ValidName("name", name); err != nil {
		return t, false, err
	}
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		root, err := tx.RootTenantID(ctx)
		if err != nil {
			return err
		}
		if root != "" {
			t, err = tx.GetTenant(ctx, root)
			return err
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		if t, err = tx.InsertTenant(ctx, ids.New(ids.Tenant, now), name); err != nil {
			return err
		}
		created = true
		if err := tx.SetRootTenantID(ctx, t.ID); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: t.ID, Actor: "system", Action: "tenant.created", Resource: authz.TenantResource(t.ID), Data: map[string]any{"name": name, "root": true}})
	})
	return t, created, err
}

// RootTenantID returns the deployment's root tenant ("" before bootstrap).
func (s *Service) RootTenantID(ctx context.Context) (string, error) {
	var id string
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		id, err = tx.RootTenantID(ctx)
		return err
	})
	return id, err
}

// CreateTenant creates a tenant. Only platform operators (root tenant) may.
func (s *Service) CreateTenant(ctx context.Context, p authz.Principal, name string) (store.Tenant, error) {
	if !p.Root || !p.Allowed(authz.TenantsCreate, authz.TenantResource("*")) {
		return store.Tenant{}, errs.New(errs.AccessDenied, "only platform operators with %s may create tenants", authz.TenantsCreate)
	}
	if err := authz.ValidName("name", name); err != nil {
		return store.Tenant{}, err
	}
	var t store.Tenant
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		t, err = tx.InsertTenant(ctx, ids.New(ids.Tenant, now), name)
		if store.IsUniqueViolation(err) {
			return errs.New(errs.AlreadyExists, "a tenant named %q exists", name)
		}
		if err != nil {
			return err
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: t.ID, Type: "tenant.created", Subject: t.ID, Data: map[string]any{"tenantId": t.ID, "name": name}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: t.ID, Actor: p.ID, Action: "tenant.created", Resource: authz.TenantResource(t.ID), Data: map[string]any{"name": name}})
	})
	return t, err
}

// GetTenant reads a tenant p may act for.
func (s *Service) GetTenant(ctx context.Context, p authz.Principal, id string) (store.Tenant, error) {
	if err := p.Require(id, authz.TenantsRead, authz.TenantResource(id)); err != nil {
		return store.Tenant{}, err
	}
	var t store.Tenant
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		t, err = tx.GetTenant(ctx, id)
		if errors.Is(err, store.ErrNotFound) {
			return notFound("tenant", id)
		}
		return err
	})
	return t, err
}

// ListTenants lists tenants: all of them for platform operators, else the
// principal's own.
func (s *Service) ListTenants(ctx context.Context, p authz.Principal, after string, limit int) ([]store.Tenant, error) {
	if !p.Root {
		if after != "" {
			return nil, nil
		}
		t, err := s.GetTenant(ctx, p, p.TenantID)
		if err != nil {
			return nil, err
		}
		return []store.Tenant{t}, nil
	}
	if !p.Allowed(authz.TenantsRead, authz.TenantResource("*")) {
		return nil, errs.New(errs.AccessDenied, "%s is required", authz.TenantsRead)
	}
	var out []store.Tenant
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		out, err = tx.ListTenants(ctx, after, limit)
		return err
	})
	return out, err
}

// CreateSite creates a site owned by tenantID. A site of the root tenant is
// a platform site; any other tenant's site is custom (tenant-controlled).
func (s *Service) CreateSite(ctx context.Context, p authz.Principal, tenantID, name, region string) (store.Site, error) {
	if err := p.Require(tenantID, authz.SitesCreate, authz.SiteResource("*")); err != nil {
		return store.Site{}, err
	}
	if err := authz.ValidName("name", name); err != nil {
		return store.Site{}, err
	}
	if region != "" {
		if err := authz.ValidName("region", region); err != nil {
			return store.Site{}, err
		}
	}
	var site store.Site
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := tx.GetTenant(ctx, tenantID); errors.Is(err, store.ErrNotFound) {
			return notFound("tenant", tenantID)
		} else if err != nil {
			return err
		}
		root, err := tx.RootTenantID(ctx)
		if err != nil {
			return err
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		site, err = tx.InsertSite(ctx, store.Site{ID: ids.New(ids.Site, now), OwnerTenantID: tenantID, Name: name, Region: region, Custom: tenantID != root})
		if store.IsUniqueViolation(err) {
			return errs.New(errs.AlreadyExists, "a site named %q exists in this tenant", name)
		}
		if err != nil {
			return err
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "site.created", Subject: site.ID, Data: map[string]any{"siteId": site.ID, "name": name, "custom": site.Custom}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "site.created", Resource: authz.SiteResource(site.ID), Data: map[string]any{"name": name, "region": region}})
	})
	return site, err
}

// visibleSite reads a site tenantID owns or a platform site.
func visibleSite(ctx context.Context, tx *store.Tx, tenantID, siteID string) (store.Site, error) {
	site, err := tx.GetSite(ctx, siteID)
	if errors.Is(err, store.ErrNotFound) {
		return site, notFound("site", siteID)
	}
	if err != nil {
		return site, err
	}
	if site.OwnerTenantID == tenantID {
		return site, nil
	}
	root, err := tx.RootTenantID(ctx)
	if err != nil {
		return site, err
	}
	if site.OwnerTenantID == root && !site.Custom {
		return site, nil
	}
	return store.Site{}, notFound("site", siteID)
}

// GetSite reads a site visible to the tenant (its own, or a platform site).
func (s *Service) GetSite(ctx context.Context, p authz.Principal, tenantID, siteID string) (store.Site, error) {
	if err := p.Require(tenantID, authz.SitesRead, authz.SiteResource(siteID)); err != nil {
		return store.Site{}, err
	}
	var site store.Site
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		site, err = visibleSite(ctx, tx, tenantID, siteID)
		return err
	})
	return site, err
}

// ListSites lists the tenant's sites and the platform's.
func (s *Service) ListSites(ctx context.Context, p authz.Principal, tenantID, after string, limit int) ([]store.Site, error) {
	if err := p.Require(tenantID, authz.SitesRead, authz.SiteResource("*")); err != nil {
		return nil, err
	}
	var out []store.Site
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		root, err := tx.RootTenantID(ctx)
		if err != nil {
			return err
		}
		out, err = tx.ListSites(ctx, tenantID, root, after, limit)
		return err
	})
	return out, err
}

// CreatePool creates a pool of tenantID on a site it owns or a platform site.
func (s *Service) CreatePool(ctx context.Context, p authz.Principal, tenantID, siteID, name, agent string, policy Policy) (store.Pool, error) {
	if err := p.Require(tenantID, authz.PoolsCreate, authz.PoolResource("*")); err != nil {
		return store.Pool{}, err
	}
	if siteID == "" {
		return store.Pool{}, errs.Invalid("siteId", "required")
	}
	if err := authz.ValidName("name", name); err != nil {
		return store.Pool{}, err
	}
	if err := authz.ValidName("agent", agent); err != nil {
		return store.Pool{}, err
	}
	if err := policy.Validate(); err != nil {
		return store.Pool{}, err
	}
	pj, err := json.Marshal(policy)
	if err != nil {
		return store.Pool{}, err
	}
	var pool store.Pool
	err = s.db.WithTx(ctx, func(tx *store.Tx) error {
		if _, err := visibleSite(ctx, tx, tenantID, siteID); err != nil {
			return err
		}
		now, err := tx.Now(ctx)
		if err != nil {
			return err
		}
		pool, err = tx.InsertPool(ctx, store.Pool{ID: ids.New(ids.Pool, now), SiteID: siteID, OwnerTenantID: tenantID, Name: name, Agent: agent, Policy: pj})
		if store.IsUniqueViolation(err) {
			return errs.New(errs.AlreadyExists, "a pool named %q exists on site %s", name, siteID)
		}
		if err != nil {
			return err
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "pool.created", Subject: pool.ID, Data: map[string]any{"poolId": pool.ID, "siteId": siteID, "name": name, "agent": agent}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "pool.created", Resource: authz.PoolResource(pool.ID), Data: map[string]any{"name": name, "siteId": siteID, "agent": agent, "policy": policy}})
	})
	return pool, err
}

// OwnedPool reads a pool inside tx and checks that tenantID owns it; any
// other pool answers NOT_FOUND.
func OwnedPool(ctx context.Context, tx *store.Tx, tenantID, poolID string) (store.Pool, error) {
	if poolID == "" {
		return store.Pool{}, errs.Invalid("poolId", "required")
	}
	pool, err := tx.GetPool(ctx, poolID)
	if errors.Is(err, store.ErrNotFound) || (err == nil && pool.OwnerTenantID != tenantID) {
		return store.Pool{}, notFound("pool", poolID)
	}
	return pool, err
}

// PoolFor reads the tenant's pool inside tx and checks that p may do
// action on it: the check of every call decided on a pool (join tokens,
// join requests, nodes made ahead). Another tenant's or a missing pool is
// NOT_FOUND.
func PoolFor(ctx context.Context, tx *store.Tx, p authz.Principal, tenantID, poolID, action string) (store.Pool, error) {
	pool, err := OwnedPool(ctx, tx, tenantID, poolID)
	if err != nil {
		return store.Pool{}, err
	}
	if err := p.Require(tenantID, action, authz.PoolResource(pool.ID)); err != nil {
		return store.Pool{}, err
	}
	return pool, nil
}

// RunsDaemon refuses (INVALID_STATE) a pool whose machines run no daemon
// (agent other than bcd) for what, which only such pools have ("join
// tokens", "nodes made ahead").
func RunsDaemon(pool store.Pool, what string) error {
	if pool.Agent != AgentBCD {
		return errs.New(errs.InvalidState, "pool %s runs no daemon (agent %q): %s are only for pools with agent %q", pool.ID, pool.Agent, what, AgentBCD)
	}
	return nil
}

// GetPool reads a pool of the tenant.
func (s *Service) GetPool(ctx context.Context, p authz.Principal, tenantID, poolID string) (store.Pool, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.Pool{}, err
	}
	var pool store.Pool
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		pool, err = OwnedPool(ctx, tx, tenantID, poolID)
		return err
	})
	if err != nil {
		return store.Pool{}, err
	}
	if err := p.Require(tenantID, authz.PoolsRead, authz.PoolResource(poolID)); err != nil {
		return store.Pool{}, err
	}
	return pool, nil
}

// ListPools lists the tenant's pools, optionally of one site.
func (s *Service) ListPools(ctx context.Context, p authz.Principal, tenantID, siteID, after string, limit int) ([]store.Pool, error) {
	if err := p.Require(tenantID, authz.PoolsRead, authz.PoolResource("*")); err != nil {
		return nil, err
	}
	var out []store.Pool
	err := s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		out, err = tx.ListPools(ctx, tenantID, siteID, after, limit)
		return err
	})
	return out, err
}

// UpdatePoolPolicy replaces a pool's policy.
func (s *Service) UpdatePoolPolicy(ctx context.Context, p authz.Principal, tenantID, poolID string, policy Policy) (store.Pool, error) {
	if err := policy.Validate(); err != nil {
		return store.Pool{}, err
	}
	return s.PatchPoolPolicy(ctx, p, tenantID, poolID, func(Policy) (Policy, error) { return policy, nil })
}

// PatchPoolPolicy changes a pool's policy to what patch makes of the stored
// one, read and written in one transaction, so two operators changing
// different fields at once both keep their change (a read-modify-write
// across two calls would lose one).
func (s *Service) PatchPoolPolicy(ctx context.Context, p authz.Principal, tenantID, poolID string, patch func(old Policy) (Policy, error)) (store.Pool, error) {
	if err := p.ActFor(tenantID); err != nil {
		return store.Pool{}, err
	}
	var pool store.Pool
	err := s.db.WithTx(ctx, func(tx *store.Tx) error {
		old, err := OwnedPool(ctx, tx, tenantID, poolID)
		if err != nil {
			return err
		}
		if err := p.Require(tenantID, authz.PoolsUpdate, authz.PoolResource(poolID)); err != nil {
			return err
		}
		if old, err = tx.LockPool(ctx, old.ID); err != nil {
			return err
		}
		prev, err := ParsePolicy(old.Policy)
		if err != nil {
			return err
		}
		policy, err := patch(prev)
		if err != nil {
			return err
		}
		if err := policy.Validate(); err != nil {
			return err
		}
		pj, err := json.Marshal(policy)
		if err != nil {
			return err
		}
		if pool, err = tx.UpdatePoolPolicy(ctx, poolID, pj); err != nil {
			return err
		}
		if err := events.Publish(ctx, tx, s.hub, events.Event{TenantID: tenantID, Type: "pool.policy-updated", Subject: poolID, Data: map[string]any{"poolId": poolID, "policy": policy}}); err != nil {
			return err
		}
		return events.Audit(ctx, tx, events.Entry{TenantID: tenantID, Actor: p.ID, Action: "pool.policy-updated", Resource: authz.PoolResource(poolID), Data: map[string]any{"old": json.RawMessage(old.Policy), "new": policy}})
	})
	return pool, err
}
