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
	// EKHash is the SHA-256 of a tpm node's endorsement key, recorded by
	// SetNodeTPMAK; nil for other attestors. Not written by InsertNode.
	EKHash      []byte
	NodeKey     string // tpm | unattested
	Attestor    string
	Hostname    string
	Claims      []byte // JSON of hwid.Claims
	JoinTokenID string
	// IdempotencyKey is the key a node made ahead was created with ("" for
	// none, and for nodes joins made).
	IdempotencyKey string
	// Authz, for InsertNode: write the node's authorization projection
	// with it (R1.3, nodeauthz.go). Joins do; a node made ahead has none
	// until the join that binds it (BindPendingNode and ReclaimNode always
	// write it). Not read back.
	Authz     bool
	CreatedAt time.Time
	UpdatedAt time.Time
}

const nodeCols = `id, tenant_id, site_id, pool_id, role, state, state_reason, connection, last_seen_ms, identity_generation,
	hardware_key, hardware_key_trusted, node_key, attestor, hostname, claims, join_token_id, COALESCE(idempotency_key, ''), created_ms, updated_ms, ek_sha256`

func scanNode(sc interface{ Scan(...any) error }) (Node, error) {
	var n Node
	var seen sql.NullInt64
	var claims string
	var created, updated int64
	if err := sc.Scan(&n.ID, &n.TenantID, &n.SiteID, &n.PoolID, &n.Role, &n.State, &n.StateReason, &n.Connection, &seen, &n.IdentityGeneration,
		&n.HardwareKey, &n.HardwareKeyTrusted, &n.NodeKey, &n.Attestor, &n.Hostname, &claims, &n.JoinTokenID, &n.IdempotencyKey, &created, &updated, &n.EKHash); err != nil {
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
			hardware_key, hardware_key_trusted, node_key, attestor, hostname, claims, join_token_id, idempotency_key, authz_ms, created_ms, updated_ms)
		VALUES (?, ?, ?, ?, ?, ?, 'disconnected', ?, ?, ?, ?, ?, ?, ?, ?, ?, CASE WHEN ? THEN compute_now() END, compute_now(), compute_now())
		RETURNING created_ms, updated_ms`,
		n.ID, n.TenantID, n.SiteID, n.PoolID, n.Role, n.State, n.IdentityGeneration, nullBytes(n.HardwareKey), n.HardwareKeyTrusted, n.NodeKey, n.Attestor,
		n.Hostname, claims, n.JoinTokenID, key, n.Authz).Scan(&created, &updated)
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
// pending at identity generation 0 takes n's state (adopting or adopted),
// role, hardware key and whether it is trusted, node key, attestor, claims
// and join token id, and generation 1; its hostname becomes n's unless n
// has none. It writes the node's authorization projection (R1.3). It fails
// with ErrNotFound when the node is no longer pending (a racing join bound
// it, or it was retired), and with a unique violation when another live
// node of the tenant holds the trusted hardware key.
func (t *Tx) BindPendingNode(ctx context.Context, n Node) (Node, error) {
	row := t.queryRow(ctx, `UPDATE nodes SET identity_generation = 1, state = ?, state_reason = '', role = ?, hardware_key = ?, hardware_key_trusted = ?,
			node_key = ?, attestor = ?, hostname = CASE WHEN ? = '' THEN hostname ELSE ? END, claims = ?, join_token_id = ?,
			authz_ms = compute_now(), updated_ms = compute_now()
		WHERE id = ? AND state = 'pending' AND identity_generation = 0 RETURNING `+nodeCols,
		n.State, n.Role, nullBytes(n.HardwareKey), n.HardwareKeyTrusted, n.NodeKey, n.Attestor, n.Hostname, n.Hostname, claimsText(n.Claims), n.JoinTokenID, n.ID)
	out, err := scanNode(row)
	if err != nil {
		return Node{}, fmt.Errorf("bind pending node: %w", notFound(err))
	}
	return out, nil
}

// ReclaimNode moves a node to its next identity generation after a reclaim:
// it keeps its id, takes n's state and the new join's facts, and its
// authorization projection is written again (R1.3).
// It fails (ErrNotFound) when the generation moved meanwhile.
func (t *Tx) ReclaimNode(ctx context.Context, n Node, fromGeneration int) (Node, error) {
	row := t.queryRow(ctx, `UPDATE nodes SET identity_generation = identity_generation + 1, state = ?, state_reason = '', role = ?,
			node_key = ?, attestor = ?, hostname = ?, claims = ?, join_token_id = ?, authz_ms = compute_now(), updated_ms = compute_now()
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
func scanNodes(rows Rows) ([]Node, error) {
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
