package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"
)

// Tenant is a tenants row.
type Tenant struct {
	ID        string
	Name      string
	CreatedAt time.Time
}

// Site is a sites row. Custom marks a tenant's own site.
type Site struct {
	ID            string
	OwnerTenantID string
	Name          string
	Region        string
	Custom        bool
	CreatedAt     time.Time
}

// Pool is a pools row. Policy is the pool policy as JSON.
type Pool struct {
	ID            string
	SiteID        string
	OwnerTenantID string
	Name          string
	Agent         string
	Policy        []byte
	CreatedAt     time.Time
	UpdatedAt     time.Time
}

// RootTenantID returns the deployment's root tenant, or "" before bootstrap.
func (t *Tx) RootTenantID(ctx context.Context) (string, error) {
	var id sql.NullString
	if err := t.queryRow(ctx, "SELECT root_tenant_id FROM deployment WHERE id = 1").Scan(&id); err != nil {
		return "", fmt.Errorf("read root tenant: %w", err)
	}
	return id.String, nil
}

// SetRootTenantID names the deployment's root tenant.
func (t *Tx) SetRootTenantID(ctx context.Context, id string) error {
	_, err := t.exec(ctx, "UPDATE deployment SET root_tenant_id = ? WHERE id = 1", id)
	return err
}

// InsertTenant inserts a tenant; its CreatedAt is compute_now().
func (t *Tx) InsertTenant(ctx context.Context, id, name string) (Tenant, error) {
	var created int64
	err := t.queryRow(ctx, "INSERT INTO tenants (id, name, created_ms) VALUES (?, ?, compute_now()) RETURNING created_ms", id, name).Scan(&created)
	if err != nil {
		return Tenant{}, fmt.Errorf("insert tenant: %w", err)
	}
	return Tenant{ID: id, Name: name, CreatedAt: fromMS(created)}, nil
}

// GetTenant reads one tenant.
func (t *Tx) GetTenant(ctx context.Context, id string) (Tenant, error) {
	var x Tenant
	var created int64
	err := t.queryRow(ctx, "SELECT id, name, created_ms FROM tenants WHERE id = ?", id).Scan(&x.ID, &x.Name, &created)
	if err != nil {
		return Tenant{}, notFound(err)
	}
	x.CreatedAt = fromMS(created)
	return x, nil
}

// ListTenants lists tenants with ids after `after`, at most limit.
func (t *Tx) ListTenants(ctx context.Context, after string, limit int) ([]Tenant, error) {
	rows, err := t.query(ctx, "SELECT id, name, created_ms FROM tenants WHERE id > ? ORDER BY id LIMIT ?", after, limit)
	if err != nil {
		return nil, fmt.Errorf("list tenants: %w", err)
	}
	defer rows.Close()
	var out []Tenant
	for rows.Next() {
		var x Tenant
		var created int64
		if err := rows.Scan(&x.ID, &x.Name, &created); err != nil {
			return nil, err
		}
		x.CreatedAt = fromMS(created)
		out = append(out, x)
	}
	return out, rows.Err()
}

const siteCols = "id, owner_tenant_id, name, region, custom, created_ms"

func scanSite(sc interface{ Scan(...any) error }) (Site, error) {
	var s Site
	var created int64
	if err := sc.Scan(&s.ID, &s.OwnerTenantID, &s.Name, &s.Region, &s.Custom, &created); err != nil {
		return Site{}, err
	}
	s.CreatedAt = fromMS(created)
	return s, nil
}

// InsertSite inserts a site.
func (t *Tx) InsertSite(ctx context.Context, s Site) (Site, error) {
	row := t.queryRow(ctx, "INSERT INTO sites ("+siteCols+") VALUES (?, ?, ?, ?, ?, compute_now()) RETURNING "+siteCols,
		s.ID, s.OwnerTenantID, s.Name, s.Region, s.Custom)
	out, err := scanSite(row)
	if err != nil {
		return Site{}, fmt.Errorf("insert site: %w", err)
	}
	return out, nil
}

// GetSite reads one site.
func (t *Tx) GetSite(ctx context.Context, id string) (Site, error) {
	s, err := scanSite(t.queryRow(ctx, "SELECT "+siteCols+" FROM sites WHERE id = ?", id))
	return s, notFound(err)
}

// ListSites lists the sites a tenant owns, plus the platform's (non-custom
// sites of the root tenant) when includePlatform is set.
func (t *Tx) ListSites(ctx context.Context, tenantID, rootID, after string, limit int) ([]Site, error) {
	rows, err := t.query(ctx, "SELECT "+siteCols+" FROM sites WHERE (owner_tenant_id = ? OR (owner_tenant_id = ? AND custom = ?)) AND id > ? ORDER BY id LIMIT ?",
		tenantID, rootID, false, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list sites: %w", err)
	}
	defer rows.Close()
	var out []Site
	for rows.Next() {
		s, err := scanSite(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}

const poolCols = "id, site_id, owner_tenant_id, name, agent, policy, created_ms, updated_ms"

func scanPool(sc interface{ Scan(...any) error }) (Pool, error) {
	var p Pool
	var policy string
	var created, updated int64
	if err := sc.Scan(&p.ID, &p.SiteID, &p.OwnerTenantID, &p.Name, &p.Agent, &policy, &created, &updated); err != nil {
		return Pool{}, err
	}
	p.Policy = []byte(policy)
	p.CreatedAt, p.UpdatedAt = fromMS(created), fromMS(updated)
	return p, nil
}

// InsertPool inserts a pool.
func (t *Tx) InsertPool(ctx context.Context, p Pool) (Pool, error) {
	row := t.queryRow(ctx, "INSERT INTO pools ("+poolCols+") VALUES (?, ?, ?, ?, ?, ?, compute_now(), compute_now()) RETURNING "+poolCols,
		p.ID, p.SiteID, p.OwnerTenantID, p.Name, p.Agent, string(p.Policy))
	out, err := scanPool(row)
	if err != nil {
		return Pool{}, fmt.Errorf("insert pool: %w", err)
	}
	return out, nil
}

// GetPool reads one pool.
func (t *Tx) GetPool(ctx context.Context, id string) (Pool, error) {
	p, err := scanPool(t.queryRow(ctx, "SELECT "+poolCols+" FROM pools WHERE id = ?", id))
	return p, notFound(err)
}

// poolSiteCols are poolCols and then siteCols, of pools p joined to sites s.
var poolSiteCols = qualify("p", poolCols) + ", " + qualify("s", siteCols)

// GetPoolWithSite reads a pool and its site in one statement.
func (t *Tx) GetPoolWithSite(ctx context.Context, id string) (Pool, Site, error) {
	row := t.queryRow(ctx, "SELECT "+poolSiteCols+" FROM pools p JOIN sites s ON s.id = p.site_id WHERE p.id = ?", id)
	var p Pool
	var s Site
	var policy string
	var pCreated, pUpdated, sCreated int64
	if err := row.Scan(&p.ID, &p.SiteID, &p.OwnerTenantID, &p.Name, &p.Agent, &policy, &pCreated, &pUpdated,
		&s.ID, &s.OwnerTenantID, &s.Name, &s.Region, &s.Custom, &sCreated); err != nil {
		return Pool{}, Site{}, notFound(err)
	}
	p.Policy = []byte(policy)
	p.CreatedAt, p.UpdatedAt, s.CreatedAt = fromMS(pCreated), fromMS(pUpdated), fromMS(sCreated)
	return p, s, nil
}

// UpdatePoolPolicy replaces a pool's policy.
func (t *Tx) UpdatePoolPolicy(ctx context.Context, id string, policy []byte) (Pool, error) {
	p, err := scanPool(t.queryRow(ctx, "UPDATE pools SET policy = ?, updated_ms = compute_now() WHERE id = ? RETURNING "+poolCols, string(policy), id))
	return p, notFound(err)
}

// ListPools lists a tenant's pools, optionally of one site.
func (t *Tx) ListPools(ctx context.Context, tenantID, siteID, after string, limit int) ([]Pool, error) {
	rows, err := t.query(ctx, "SELECT "+poolCols+" FROM pools WHERE owner_tenant_id = ? AND (? = '' OR site_id = ?) AND id > ? ORDER BY id LIMIT ?",
		tenantID, siteID, siteID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	defer rows.Close()
	var out []Pool
	for rows.Next() {
		p, err := scanPool(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, p)
	}
	return out, rows.Err()
}
