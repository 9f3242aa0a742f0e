package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"time"
)

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

// CurrentNodeCert returns the newest unrevoked certificate of a node's
// identity generation: the one whose allowed kinds decide what may be
// queued for the node (R7.5).
func (t *Tx) CurrentNodeCert(ctx context.Context, nodeID string, generation int) (NodeCert, error) {
	c, err := scanCert(t.queryRow(ctx, "SELECT "+certCols+" FROM node_certs WHERE node_id = ? AND identity_generation = ? AND revoked_ms IS NULL ORDER BY created_ms DESC, serial DESC LIMIT 1",
		nodeID, generation))
	return c, notFound(err)
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

// RevokeNodeCert revokes one certificate by serial, unless it already is
// revoked. It reports whether it revoked it.
func (t *Tx) RevokeNodeCert(ctx context.Context, serial, reason string) (bool, error) {
	res, err := t.exec(ctx, "UPDATE node_certs SET revoked_ms = compute_now(), revoke_reason = ? WHERE serial = ? AND revoked_ms IS NULL", reason, serial)
	if err != nil {
		return false, fmt.Errorf("revoke node cert: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("revoke node cert: %w", err)
	}
	return n == 1, nil
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

// RevokeAllNodeCerts revokes every unrevoked certificate of a node, of any
// identity generation, and returns their serials (retiring a node).
func (t *Tx) RevokeAllNodeCerts(ctx context.Context, nodeID, reason string) ([]string, error) {
	return t.RevokeNodeCerts(ctx, nodeID, math.MaxInt32, reason)
}
