package api

import (
	"context"
	"time"

	"connectrpc.com/connect"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/controlplane/authz"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/controlplane/tenancy"
	"github.com/better-compute/better-compute/internal/controlplane/tokens"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// operator implements the operator API's services. Handlers only translate:
// the decisions live in the domain packages.
type operator struct {
	s *Server
}

func principal(ctx context.Context) (authz.Principal, error) {
	p, ok := authz.From(ctx)
	if !ok {
		return p, errs.New(errs.Unauthenticated, "a valid API key is required")
	}
	return p, nil
}

func (o *operator) root(ctx context.Context) string {
	id, _ := o.s.tenancy.RootTenantID(ctx)
	return id
}

func (o *operator) CreateTenant(ctx context.Context, req *connect.Request[bcv1.CreateTenantRequest]) (*connect.Response[bcv1.Tenant], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	t, err := o.s.tenancy.CreateTenant(ctx, p, req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(tenantPB(t, o.root(ctx))), nil
}

func (o *operator) GetTenant(ctx context.Context, req *connect.Request[bcv1.GetTenantRequest]) (*connect.Response[bcv1.Tenant], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	t, err := o.s.tenancy.GetTenant(ctx, p, req.Msg.GetTenantId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(tenantPB(t, o.root(ctx))), nil
}

func (o *operator) ListTenants(ctx context.Context, req *connect.Request[bcv1.ListTenantsRequest]) (*connect.Response[bcv1.ListTenantsResponse], error) {
	root := o.root(ctx)
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.Tenant, error) {
		return o.s.tenancy.ListTenants(ctx, p, after, limit)
	}, func(x store.Tenant) string { return x.ID }, func(t store.Tenant) *bcv1.Tenant { return tenantPB(t, root) })
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListTenantsResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) CreateSite(ctx context.Context, req *connect.Request[bcv1.CreateSiteRequest]) (*connect.Response[bcv1.Site], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	s, err := o.s.tenancy.CreateSite(ctx, p, req.Msg.GetTenantId(), req.Msg.GetName(), req.Msg.GetRegion())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sitePB(s)), nil
}

func (o *operator) GetSite(ctx context.Context, req *connect.Request[bcv1.GetSiteRequest]) (*connect.Response[bcv1.Site], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	s, err := o.s.tenancy.GetSite(ctx, p, req.Msg.GetTenantId(), req.Msg.GetSiteId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sitePB(s)), nil
}

func (o *operator) ListSites(ctx context.Context, req *connect.Request[bcv1.ListSitesRequest]) (*connect.Response[bcv1.ListSitesResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.Site, error) {
		return o.s.tenancy.ListSites(ctx, p, req.Msg.GetTenantId(), after, limit)
	}, func(x store.Site) string { return x.ID }, sitePB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListSitesResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) CreatePool(ctx context.Context, req *connect.Request[bcv1.CreatePoolRequest]) (*connect.Response[bcv1.Pool], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	pool, err := o.s.tenancy.CreatePool(ctx, p, m.GetTenantId(), m.GetSiteId(), m.GetName(), m.GetAgent(), policyFromPB(m.GetPolicy()))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(poolPB(pool)), nil
}

func (o *operator) GetPool(ctx context.Context, req *connect.Request[bcv1.GetPoolRequest]) (*connect.Response[bcv1.Pool], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	pool, err := o.s.tenancy.GetPool(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(poolPB(pool)), nil
}

func (o *operator) ListPools(ctx context.Context, req *connect.Request[bcv1.ListPoolsRequest]) (*connect.Response[bcv1.ListPoolsResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.Pool, error) {
		return o.s.tenancy.ListPools(ctx, p, req.Msg.GetTenantId(), req.Msg.GetSiteId(), after, limit)
	}, func(x store.Pool) string { return x.ID }, poolPB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListPoolsResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) UpdatePoolPolicy(ctx context.Context, req *connect.Request[bcv1.UpdatePoolPolicyRequest]) (*connect.Response[bcv1.Pool], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	var pool store.Pool
	if paths := m.GetUpdateMask().GetPaths(); len(paths) > 0 {
		if err := checkPolicyMask(paths); err != nil {
			return nil, err
		}
		pool, err = o.s.tenancy.PatchPoolPolicy(ctx, p, m.GetTenantId(), m.GetPoolId(), func(old tenancy.Policy) (tenancy.Policy, error) {
			return mergePolicy(old, m.GetPolicy(), paths), nil
		})
	} else {
		pool, err = o.s.tenancy.UpdatePoolPolicy(ctx, p, m.GetTenantId(), m.GetPoolId(), policyFromPB(m.GetPolicy()))
	}
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(poolPB(pool)), nil
}

func (o *operator) CreateApiKey(ctx context.Context, req *connect.Request[bcv1.CreateApiKeyRequest]) (*connect.Response[bcv1.CreateApiKeyResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	var grants []authz.Grant
	for _, g := range req.Msg.GetGrants() {
		grants = append(grants, authz.Grant{Action: g.GetAction(), Resource: g.GetResource()})
	}
	row, bearer, err := o.s.authz.CreateKey(ctx, p, req.Msg.GetTenantId(), req.Msg.GetName(), grants, time.Duration(req.Msg.GetTtlSeconds())*time.Second)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.CreateApiKeyResponse{ApiKey: apiKeyPB(row), Key: bearer}), nil
}

func (o *operator) ListApiKeys(ctx context.Context, req *connect.Request[bcv1.ListApiKeysRequest]) (*connect.Response[bcv1.ListApiKeysResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.APIKeyRow, error) {
		return o.s.authz.ListKeys(ctx, p, req.Msg.GetTenantId(), after, limit)
	}, func(x store.APIKeyRow) string { return x.ID }, apiKeyPB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListApiKeysResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) RevokeApiKey(ctx context.Context, req *connect.Request[bcv1.RevokeApiKeyRequest]) (*connect.Response[bcv1.RevokeApiKeyResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if err := o.s.authz.RevokeKey(ctx, p, req.Msg.GetTenantId(), req.Msg.GetApiKeyId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.RevokeApiKeyResponse{}), nil
}

func (o *operator) CreateJoinToken(ctx context.Context, req *connect.Request[bcv1.CreateJoinTokenRequest]) (*connect.Response[bcv1.JoinToken], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	e := m.GetExpect()
	created, err := o.s.tokens.Create(ctx, p, tokens.CreateRequest{
		TenantID: m.GetTenantId(), PoolID: m.GetPoolId(), TTL: time.Duration(m.GetTtlSeconds()) * time.Second, MaxUses: int(m.GetMaxUses()),
		Expect:       hwid.Expect{ProductUUID: e.GetProductUuid(), Serial: e.GetSerial(), MAC: e.GetMac(), GPUUUID: e.GetGpuUuid()},
		AllowReclaim: m.GetAllowReclaim(), Hosted: m.GetHosted(), IdempotencyKey: m.GetIdempotencyKey(),
	})
	if err != nil {
		return nil, err
	}
	out := joinTokenPB(created.Token)
	out.Token = created.Bearer
	return connect.NewResponse(out), nil
}

func (o *operator) ListJoinTokens(ctx context.Context, req *connect.Request[bcv1.ListJoinTokensRequest]) (*connect.Response[bcv1.ListJoinTokensResponse], error) {
	pg, err := listPage(ctx, req.Msg.GetPageSize(), req.Msg.GetPageToken(), func(p authz.Principal, after string, limit int) ([]store.JoinToken, error) {
		return o.s.tokens.List(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId(), req.Msg.GetIncludeInactive(), after, limit)
	}, func(x store.JoinToken) string { return x.ID }, joinTokenPB)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&bcv1.ListJoinTokensResponse{Items: pg.items, NextPageToken: pg.next}), nil
}

func (o *operator) RevokeJoinToken(ctx context.Context, req *connect.Request[bcv1.RevokeJoinTokenRequest]) (*connect.Response[bcv1.JoinToken], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	t, err := o.s.tokens.Revoke(ctx, p, req.Msg.GetTenantId(), req.Msg.GetPoolId(), req.Msg.GetTokenId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(joinTokenPB(t)), nil
}

const maxWait = 30 * time.Second

func (o *operator) ListEvents(ctx context.Context, req *connect.Request[bcv1.ListEventsRequest]) (*connect.Response[bcv1.ListEventsResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	tenant := m.GetTenantId()
	if err := p.Require(tenant, authz.EventsRead, authz.TenantResource(tenant)); err != nil {
		return nil, err
	}
	limit, err := page("limit", m.GetLimit())
	if err != nil {
		return nil, err
	}
	if len(m.GetTypePrefix()) > 100 {
		return nil, errs.Invalid("typePrefix", "at most 100 characters")
	}
	wait := time.Duration(m.GetWaitSeconds()) * time.Second
	if wait < 0 || wait > maxWait {
		return nil, errs.Invalid("waitSeconds", "0 to 30")
	}
	// R14.3: positions leave the API sealed for the tenant (events,
	// cursor.go); a cursor of another tenant is refused as malformed.
	txo, id, err := o.s.cursors.EventPosition(ctx, o.s.db, tenant, m.GetCursor())
	if err != nil {
		return nil, err
	}
	next := m.GetCursor()
	if next != "" {
		// The same string for a sealed cursor; a decimal one of an
		// earlier version comes back sealed.
		next = o.s.cursors.EventCursor(tenant, txo, id)
	}
	clk := o.s.cfg.Clock
	deadline := clk.Now().Add(wait)
	for {
		items, err := o.waitEvents(ctx, tenant, txo, id, m.GetTypePrefix(), limit, wait > 0, deadline)
		if err != nil {
			return nil, err
		}
		if items == nil {
			continue
		}
		out := &bcv1.ListEventsResponse{NextCursor: next}
		for _, e := range items {
			ev := EventPB(o.s.cursors, e)
			out.Events = append(out.Events, ev)
			out.NextCursor = ev.Cursor
		}
		return connect.NewResponse(out), nil
	}
}

// waitEvents reads the tenant's events after (txo, id) once. When there are
// none and the caller waits until deadline, it then waits for the tenant's
// next event on this replica, at most a second (other replicas publish too:
// it polls), and answers nil to be called again; else it answers what it
// read, empty but not nil when there was nothing.
func (o *operator) waitEvents(ctx context.Context, tenant string, txo, id int64, prefix string, limit int, wait bool, deadline time.Time) ([]store.Event, error) {
	// Taken before the read, so an event committed after it wakes us.
	// SECURITY: only this tenant's events wake this reader (R14.3).
	wake, release := o.s.hub.WaitTenant(tenant)
	defer release()
	var items []store.Event
	err := o.s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		items, err = tx.ListEvents(ctx, tenant, txo, id, prefix, limit)
		return err
	})
	if err != nil {
		return nil, err
	}
	clk := o.s.cfg.Clock
	if len(items) > 0 || !wait || !clk.Now().Before(deadline) {
		if items == nil {
			items = []store.Event{}
		}
		return items, nil
	}
	t := clk.NewTimer(min(deadline.Sub(clk.Now()), time.Second))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-wake:
	case <-t.C():
	}
	return nil, nil
}

// ListAudit reads a tenant's audit rows oldest first with a cursor, in the
// order events are read. Ids and cursors are sealed as
// events' are (R14.3).
func (o *operator) ListAudit(ctx context.Context, req *connect.Request[bcv1.ListAuditRequest]) (*connect.Response[bcv1.ListAuditResponse], error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	m := req.Msg
	tenant := m.GetTenantId()
	if err := p.Require(tenant, authz.AuditRead, authz.TenantResource(tenant)); err != nil {
		return nil, err
	}
	limit, err := page("pageSize", m.GetPageSize())
	if err != nil {
		return nil, err
	}
	after, err := o.s.cursors.AuditPosition(ctx, o.s.db, tenant, m.GetCursor())
	if err != nil {
		return nil, err
	}
	var items []store.AuditEntry
	err = o.s.db.ReadTx(ctx, func(tx *store.Tx) error {
		var err error
		items, err = tx.ListAuditAfter(ctx, tenant, after, limit)
		return err
	})
	if err != nil {
		return nil, err
	}
	out := &bcv1.ListAuditResponse{NextCursor: m.GetCursor()}
	if after > 0 {
		out.NextCursor = o.s.cursors.AuditCursor(tenant, after)
	}
	for _, a := range items {
		entry := AuditPB(o.s.cursors, a)
		out.Items = append(out.Items, entry)
		out.NextCursor = entry.Cursor
	}
	return connect.NewResponse(out), nil
}
