package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Node states.
const (
	// NodePending is a node made ahead of its machine (nodes.create):
	// identity generation 0, no hardware key, no attestor or node key,
	// until a join binds a machine to it (BindPendingNode).
	NodePending  = "pending"
	NodeAdopting = "adopting"
	NodeAdopted  = "adopted"
	NodeFailed   = "failed"
	NodeRetired  = "retired"
)

// Node is a nodes row.
type Node struct {
	ID                 string
	TenantID           string
	SiteID             string
	PoolID             string
	Role               string
	State              string
	StateReason        string
	Connection         string
	LastSeen           *time.Time
	IdentityGeneration int
	HardwareKey        []byte
	HardwareKeyTrusted bool
	NodeKey            string // tpm | unattested
	Attestor           string
	Hostname           string
	Claims             []byte // JSON of hwid.Claims
	JoinTokenID        string
	// IdempotencyKey is the key a node made ahead was created with ("" for
	// none, and for nodes joins made).
	IdempotencyKey string
	CreatedAt      time.Time
	UpdatedAt      time.Time
}

const nodeCols = `id, tenant_id, site_id, pool_id, role, state, state_reason, connection, last_seen_ms, identity_generation,
	hardware_key, hardware_key_trusted, node_key, attestor, hostname, claims, join_token_id, COALESCE(idempotency_key, ''), created_ms, updated_ms`

func scanNode(sc interface{ Scan(...any) error }) (Node, error) {
	var n Node
	var seen sql.NullInt64
	var claims string
	var created, updated int64
	if err := sc.Scan(&n.ID, &n.TenantID, &n.SiteID, &n.PoolID, &n.Role, &n.State, &n.StateReason, &n.Connection, &seen, &n.IdentityGeneration,
		&n.HardwareKey, &n.HardwareKeyTrusted, &n.NodeKey, &n.Attestor, &n.Hostname, &claims, &n.JoinTokenID, &n.IdempotencyKey, &created, &updated); err != nil {
		return Node{}, err
	}
	n.LastSeen, n.Claims = fromNullMS(seen), []byte(claims)
	n.CreatedAt, n.UpdatedAt = fromMS(created), fromMS(updated)
	return n, nil
}

// NodesByHardwareKey lists up to limit live (not retired) nodes of any
// tenant holding a trusted hardware key, in one query: the caller matches
// its own tenant's (at most one: the unique index is per tenant) and
// reports the others as a cross-tenant collision.
//
// The predicate repeats the partial index's own (nodes_hardware_key_tenant:
// trusted and not retired) as literal text. With the flag as a bound
// parameter, SQLite can use the index only by matching the bound value, so
// it re-prepares the statement each time the flag is bound (every join;
// 31.5 -> 27.1 us per query on a 50,000-node table), and PostgreSQL cannot
// use it in a generic plan: it plans the statement on every execution, and
// with plan_cache_mode = force_generic_plan it scans the whole table.
func (t *Tx) NodesByHardwareKey(ctx context.Context, key []byte, limit int) ([]Node, error) {
	rows, err := t.query(ctx, nodesByHardwareKeySQL(t.db.dialect), key, limit)
	if err != nil {
		return nil, fmt.Errorf("find nodes by hardware key: %w", err)
	}
	return scanNodes(rows)
}

// nodesByHardwareKeySQL is NodesByHardwareKey's query (args: key, limit).
func nodesByHardwareKeySQL(d Dialect) string {
	if d == Postgres {
		return "SELECT " + nodeCols + " FROM nodes WHERE hardware_key = ? AND hardware_key_trusted AND state <> 'retired' ORDER BY id LIMIT ?"
	}
	return "SELECT " + nodeCols + " FROM nodes WHERE hardware_key = ? AND hardware_key_trusted = 1 AND state <> 'retired' ORDER BY id LIMIT ?"
}

// NodeKeyIssued reports whether any certificate of the node, of any
// generation, certified the key with this SPKI hash.
func (t *Tx) NodeKeyIssued(ctx context.Context, nodeID string, spkiSHA256 []byte) (bool, error) {
	var one int
	err := t.queryRow(ctx, "SELECT 1 FROM node_certs WHERE node_id = ? AND spki_sha256 = ? LIMIT 1", nodeID, spkiSHA256).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("find issued key: %w", err)
	}
	return true, nil
}

// SupersedeNodeCert marks a certificate superseded by its successor at at
// (the identity core's clock, which its overlap is measured on). It
// reports false when the certificate was already superseded or revoked:
// another renewal from the same parent won.
func (t *Tx) SupersedeNodeCert(ctx context.Context, serial string, at time.Time) (bool, error) {
	res, err := t.exec(ctx, "UPDATE node_certs SET superseded_ms = ? WHERE serial = ? AND superseded_ms IS NULL AND revoked_ms IS NULL", ms(at), serial)
	if err != nil {
		return false, fmt.Errorf("supersede node cert: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("supersede node cert: %w", err)
	}
	return n == 1, nil
}

// GetNode reads a node.
func (t *Tx) GetNode(ctx context.Context, id string) (Node, error) {
	n, err := scanNode(t.queryRow(ctx, "SELECT "+nodeCols+" FROM nodes WHERE id = ?", id))
	return n, notFound(err)
}

// InsertNode inserts a node. Two joins of one machine racing each other
// meet at the unique hardware-key index, and two creations with one
// idempotency key at the per-tenant key index: the loser gets a unique
// violation.
func (t *Tx) InsertNode(ctx context.Context, n Node) (Node, error) {
	var key any
	if n.IdempotencyKey != "" {
		key = n.IdempotencyKey
	}
	claims := claimsText(n.Claims)
	// Only the database's clock is returned: every other column is what
	// was written (or its default), so the row is built here rather than
	// read back (a join's hottest statement; returning the whole row cost
	// a name and a scan per column).
	var created, updated int64
	err := t.queryRow(ctx, `INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, connection, identity_generation,
			hardware_key, hardware_key_trusted, node_key, attestor, hostname, claims, join_token_id, idempotency_key, created_ms, updated_ms)
		VALUES (?, ?, ?, ?, ?, ?, 'disconnected', ?, ?, ?, ?, ?, ?, ?, ?, ?, compute_now(), compute_now()) RETURNING created_ms, updated_ms`,
		n.ID, n.TenantID, n.SiteID, n.PoolID, n.Role, n.State, n.IdentityGeneration, nullBytes(n.HardwareKey), n.HardwareKeyTrusted, n.NodeKey, n.Attestor,
		n.Hostname, claims, n.JoinTokenID, key).Scan(&created, &updated)
	if err != nil {
		return Node{}, fmt.Errorf("insert node: %w", err)
	}
	out := n
	out.StateReason, out.Connection, out.LastSeen = "", "disconnected", nil
	if len(out.HardwareKey) == 0 {
		out.HardwareKey = nil
	}
	out.Claims = []byte(claims)
	out.CreatedAt, out.UpdatedAt = fromMS(created), fromMS(updated)
	return out, nil
}

// NodeByIdempotencyKey reads the tenant's node created with an idempotency
// key; ErrNotFound when there is none.
func (t *Tx) NodeByIdempotencyKey(ctx context.Context, tenantID, key string) (Node, error) {
	n, err := scanNode(t.queryRow(ctx, "SELECT "+nodeCols+" FROM nodes WHERE tenant_id = ? AND idempotency_key = ?", tenantID, key))
	return n, notFound(err)
}

// BindPendingNode binds a machine to a node made ahead of it: a node still
// pending at identity generation 0 takes n's state (adopting), role,
// hardware key and whether it is trusted, node key, attestor, claims and
// join token id, and generation 1; its hostname becomes n's unless n has
// none. It fails with ErrNotFound when the node is no longer pending (a
// racing join bound it, or it was retired), and with a unique violation
// when another live node of the tenant holds the trusted hardware key.
func (t *Tx) BindPendingNode(ctx context.Context, n Node) (Node, error) {
	row := t.queryRow(ctx, `UPDATE nodes SET identity_generation = 1, state = ?, state_reason = '', role = ?, hardware_key = ?, hardware_key_trusted = ?,
			node_key = ?, attestor = ?, hostname = CASE WHEN ? = '' THEN hostname ELSE ? END, claims = ?, join_token_id = ?, updated_ms = compute_now()
		WHERE id = ? AND state = 'pending' AND identity_generation = 0 RETURNING `+nodeCols,
		n.State, n.Role, nullBytes(n.HardwareKey), n.HardwareKeyTrusted, n.NodeKey, n.Attestor, n.Hostname, n.Hostname, claimsText(n.Claims), n.JoinTokenID, n.ID)
	out, err := scanNode(row)
	if err != nil {
		return Node{}, fmt.Errorf("bind pending node: %w", notFound(err))
	}
	return out, nil
}

// ReclaimNode moves a node to its next identity generation after a reclaim:
// it keeps its id, starts adopting again, and takes the new join's facts.
// It fails (ErrNotFound) when the generation moved meanwhile.
func (t *Tx) ReclaimNode(ctx context.Context, n Node, fromGeneration int) (Node, error) {
	row := t.queryRow(ctx, `UPDATE nodes SET identity_generation = identity_generation + 1, state = ?, state_reason = '', role = ?,
			node_key = ?, attestor = ?, hostname = ?, claims = ?, join_token_id = ?, updated_ms = compute_now()
		WHERE id = ? AND identity_generation = ? RETURNING `+nodeCols,
		n.State, n.Role, n.NodeKey, n.Attestor, n.Hostname, string(n.Claims), n.JoinTokenID, n.ID, fromGeneration)
	out, err := scanNode(row)
	return out, notFound(err)
}

// AdoptNode moves an adopting node to adopted in one statement (R4.5) and
// returns it as it was read by that statement; ok is false when the node
// is gone or no longer adopting (nothing changed).
func (t *Tx) AdoptNode(ctx context.Context, id string) (n Node, ok bool, err error) {
	err = t.queryRow(ctx, `UPDATE nodes SET state = 'adopted', state_reason = '', updated_ms = compute_now()
		WHERE id = ? AND state = 'adopting' RETURNING id, tenant_id, pool_id, identity_generation`, id).Scan(&n.ID, &n.TenantID, &n.PoolID, &n.IdentityGeneration)
	if errors.Is(err, sql.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, fmt.Errorf("adopt node: %w", err)
	}
	n.State = NodeAdopted
	return n, true, nil
}

// SetNodeState changes a node's lifecycle state.
func (t *Tx) SetNodeState(ctx context.Context, id, state, reason string) error {
	_, err := t.exec(ctx, "UPDATE nodes SET state = ?, state_reason = ?, updated_ms = compute_now() WHERE id = ?", state, reason, id)
	return err
}

// ListNodes lists a tenant's nodes, optionally of one pool.
func (t *Tx) ListNodes(ctx context.Context, tenantID, poolID, after string, limit int) ([]Node, error) {
	rows, err := t.query(ctx, "SELECT "+nodeCols+" FROM nodes WHERE tenant_id = ? AND (? = '' OR pool_id = ?) AND id > ? ORDER BY id LIMIT ?",
		tenantID, poolID, poolID, after, limit)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	return scanNodes(rows)
}

// scanNodes reads every node row of rows and closes them.
func scanNodes(rows *sql.Rows) ([]Node, error) {
	defer rows.Close()
	var out []Node
	for rows.Next() {
		n, err := scanNode(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, rows.Err()
}

// NodeCert is a node_certs row: every certificate ever issued to a node.
type NodeCert struct {
	Serial             string
	NodeID             string
	IdentityGeneration int
	Role               string
	SPKISHA256         []byte
	DER                []byte
	AllowedKinds       []byte // JSON array
	Statements         []byte // JSON array
	NotBefore          time.Time
	NotAfter           time.Time
	CreatedAt          time.Time
	RevokedAt          *time.Time
	RevokeReason       string
	// SupersededAt is when a renewal issued this certificate's successor.
	SupersededAt *time.Time
}

const certCols = "serial, node_id, identity_generation, role, spki_sha256, der, allowed_kinds, statements, not_before_ms, not_after_ms, created_ms, revoked_ms, revoke_reason, superseded_ms"

func scanCert(sc interface{ Scan(...any) error }) (NodeCert, error) {
	var c NodeCert
	var kinds, stmts string
	var nb, na, created int64
	var rev, sup sql.NullInt64
	if err := sc.Scan(&c.Serial, &c.NodeID, &c.IdentityGeneration, &c.Role, &c.SPKISHA256, &c.DER, &kinds, &stmts, &nb, &na, &created, &rev, &c.RevokeReason, &sup); err != nil {
		return NodeCert{}, err
	}
	c.SupersededAt = fromNullMS(sup)
	c.AllowedKinds, c.Statements = []byte(kinds), []byte(stmts)
	c.NotBefore, c.NotAfter, c.CreatedAt, c.RevokedAt = fromMS(nb), fromMS(na), fromMS(created), fromNullMS(rev)
	return c, nil
}

// InsertNodeCert records an issued certificate.
func (t *Tx) InsertNodeCert(ctx context.Context, c NodeCert) error {
	if len(c.AllowedKinds) == 0 {
		c.AllowedKinds = []byte("[]")
	}
	if len(c.Statements) == 0 {
		c.Statements = []byte("[]")
	}
	err := t.execLater(ctx, "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, allowed_kinds, statements, not_before_ms, not_after_ms, created_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, compute_now())",
		c.Serial, c.NodeID, c.IdentityGeneration, c.Role, c.SPKISHA256, c.DER, string(c.AllowedKinds), string(c.Statements), ms(c.NotBefore), ms(c.NotAfter))
	if err != nil {
		return fmt.Errorf("insert node cert: %w", err)
	}
	return nil
}

// GetNodeCert reads a certificate by serial.
func (t *Tx) GetNodeCert(ctx context.Context, serial string) (NodeCert, error) {
	c, err := scanCert(t.queryRow(ctx, "SELECT "+certCols+" FROM node_certs WHERE serial = ?", serial))
	return c, notFound(err)
}

// certNodeCols are certCols of node_certs c then nodeCols of nodes n.
const certNodeCols = `c.serial, c.node_id, c.identity_generation, c.role, c.spki_sha256, c.der, c.allowed_kinds, c.statements, c.not_before_ms,
	c.not_after_ms, c.created_ms, c.revoked_ms, c.revoke_reason, c.superseded_ms,
	n.id, n.tenant_id, n.site_id, n.pool_id, n.role, n.state, n.state_reason, n.connection, n.last_seen_ms, n.identity_generation,
	n.hardware_key, n.hardware_key_trusted, n.node_key, n.attestor, n.hostname, n.claims, n.join_token_id, COALESCE(n.idempotency_key, ''),
	n.created_ms, n.updated_ms`

// GetNodeCertAndNode reads a certificate by serial together with its node,
// in one statement (a presented certificate is always checked against
// both).
func (t *Tx) GetNodeCertAndNode(ctx context.Context, serial string) (NodeCert, Node, error) {
	var c NodeCert
	var n Node
	var kinds, stmts, claims string
	var nb, na, created, nCreated, nUpdated int64
	var rev, sup, seen sql.NullInt64
	err := t.queryRow(ctx, "SELECT "+certNodeCols+" FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?", serial).Scan(
		&c.Serial, &c.NodeID, &c.IdentityGeneration, &c.Role, &c.SPKISHA256, &c.DER, &kinds, &stmts, &nb, &na, &created, &rev, &c.RevokeReason, &sup,
		&n.ID, &n.TenantID, &n.SiteID, &n.PoolID, &n.Role, &n.State, &n.StateReason, &n.Connection, &seen, &n.IdentityGeneration,
		&n.HardwareKey, &n.HardwareKeyTrusted, &n.NodeKey, &n.Attestor, &n.Hostname, &claims, &n.JoinTokenID, &n.IdempotencyKey, &nCreated, &nUpdated)
	if err != nil {
		return NodeCert{}, Node{}, notFound(err)
	}
	c.SupersededAt = fromNullMS(sup)
	c.AllowedKinds, c.Statements = []byte(kinds), []byte(stmts)
	c.NotBefore, c.NotAfter, c.CreatedAt, c.RevokedAt = fromMS(nb), fromMS(na), fromMS(created), fromNullMS(rev)
	n.LastSeen, n.Claims = fromNullMS(seen), []byte(claims)
	n.CreatedAt, n.UpdatedAt = fromMS(nCreated), fromMS(nUpdated)
	return c, n, nil
}

// ListNodeCerts lists a node's certificates, newest first.
func (t *Tx) ListNodeCerts(ctx context.Context, nodeID string, limit int) ([]NodeCert, error) {
	rows, err := t.query(ctx, "SELECT "+certCols+" FROM node_certs WHERE node_id = ? ORDER BY created_ms DESC, serial LIMIT ?", nodeID, limit)
	if err != nil {
		return nil, fmt.Errorf("list node certs: %w", err)
	}
	defer rows.Close()
	var out []NodeCert
	for rows.Next() {
		c, err := scanCert(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// RevokeNodeCerts revokes a node's unrevoked certificates of generations
// below `below` and returns their serials.
func (t *Tx) RevokeNodeCerts(ctx context.Context, nodeID string, below int, reason string) ([]string, error) {
	rows, err := t.query(ctx, "SELECT serial FROM node_certs WHERE node_id = ? AND identity_generation < ? AND revoked_ms IS NULL ORDER BY serial", nodeID, below)
	if err != nil {
		return nil, fmt.Errorf("find certs to revoke: %w", err)
	}
	var serials []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			rows.Close()
			return nil, err
		}
		serials = append(serials, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(serials) == 0 {
		return nil, nil
	}
	_, err = t.exec(ctx, "UPDATE node_certs SET revoked_ms = compute_now(), revoke_reason = ? WHERE node_id = ? AND identity_generation < ? AND revoked_ms IS NULL", reason, nodeID, below)
	if err != nil {
		return nil, fmt.Errorf("revoke node certs: %w", err)
	}
	return serials, nil
}

// UpsertNodeAuthz writes a node's authorization projection row.
func (t *Tx) UpsertNodeAuthz(ctx context.Context, nodeID, tenantID, siteID, poolID, role string) error {
	err := t.execLater(ctx, `INSERT INTO node_authz (node_id, tenant_id, site_id, pool_id, role, updated_ms) VALUES (?, ?, ?, ?, ?, compute_now())
		ON CONFLICT (node_id) DO UPDATE SET tenant_id = excluded.tenant_id, site_id = excluded.site_id, pool_id = excluded.pool_id, role = excluded.role, updated_ms = excluded.updated_ms`,
		nodeID, tenantID, siteID, poolID, role)
	if err != nil {
		return fmt.Errorf("upsert node authz: %w", err)
	}
	return nil
}

// NodeAuthz is a node's authorization projection.
type NodeAuthz struct {
	NodeID, TenantID, SiteID, PoolID, Role string
}

// GetNodeAuthz reads a node's projection row.
func (t *Tx) GetNodeAuthz(ctx context.Context, nodeID string) (NodeAuthz, error) {
	var a NodeAuthz
	err := t.queryRow(ctx, "SELECT node_id, tenant_id, site_id, pool_id, role FROM node_authz WHERE node_id = ?", nodeID).Scan(&a.NodeID, &a.TenantID, &a.SiteID, &a.PoolID, &a.Role)
	return a, notFound(err)
}

// WorkItem is a work_queue row.
type WorkItem struct {
	ID       int64
	Kind     string
	NodeID   string
	Attempts int
	// Owner is the controller that claimed it (ClaimWorkAs), "" for none.
	Owner string
}

// EnqueueWork queues work for the controllers.
func (t *Tx) EnqueueWork(ctx context.Context, kind, nodeID string) error {
	err := t.execLater(ctx, "INSERT INTO work_queue (kind, node_id, not_before_ms, created_ms) VALUES (?, ?, compute_now(), compute_now())", kind, nodeID)
	if err != nil {
		return fmt.Errorf("enqueue %s: %w", kind, err)
	}
	return nil
}

// ClaimWork claims like ClaimWorkAs for no owner: the items come back
// when lease ran out.
func (t *Tx) ClaimWork(ctx context.Context, limit int, lease time.Duration) ([]WorkItem, error) {
	return t.ClaimWorkAs(ctx, "", limit, lease)
}

// FinishWork removes a done item; an owned item only while its claimer
// still owns it (else ErrLeaseLost, see workowners.go).
func (t *Tx) FinishWork(ctx context.Context, w WorkItem) error {
	res, err := t.exec(ctx, "DELETE FROM work_queue WHERE id = ? AND COALESCE(owner, '') = ?", w.ID, w.Owner)
	return ownedRow(res, err)
}

// FailWork records an error and retries the item after backoff, releasing
// it; an owned item only while its claimer still owns it (else
// ErrLeaseLost).
func (t *Tx) FailWork(ctx context.Context, w WorkItem, msg string, backoff time.Duration) error {
	res, err := t.exec(ctx, "UPDATE work_queue SET last_error = ?, not_before_ms = compute_now() + ?, owner = NULL WHERE id = ? AND COALESCE(owner, '') = ?",
		msg, backoff.Milliseconds(), w.ID, w.Owner)
	return ownedRow(res, err)
}
